"""In a real browser: ScalerExplorer (notebook 04) and the profile widget (notebook 07).

Each notebook runs in JupyterLab in headless Chromium (``Run All``); then every chart of its
widget must be drawn (plotly plots with their traces, the fp16 range bands, the scaler's
timeline), and again after a page **reload**, when the views are rebuilt from the kernel's
widget state: a figure kept only in the browser (a ``FigureWidget``'s updates made before
its view existed) would come back empty. Screenshots of each state are saved in the test's
temporary directory and, with ``MPNB_SHOTS=<dir>``, copied there.

Chromium and the server come from :mod:`test_browser` (same skip rules, bounded waits).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from .test_browser import ROOT, StaticWidget, _wait_kernel, chromium, select_tab, serve_lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _shot(locator, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    locator.screenshot(path=str(path))
    assert path.stat().st_size > 5_000
    if os.environ.get("MPNB_SHOTS"):
        Path(os.environ["MPNB_SHOTS"]).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(os.environ["MPNB_SHOTS"]) / path.name)


def _open(browser, base, token, name):
    page = browser.new_page(viewport={"width": 1400, "height": 2000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.goto(f"{base}/lab/tree/{name}?token={token}", timeout=120_000)
    _wait_kernel(page)
    return page, errors


def _run_all(page, last_text: str, timeout_ms: int = 420_000) -> None:
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.locator(f".jp-OutputArea-output pre:has-text('{last_text}')").first.wait_for(
        timeout=timeout_ms
    )
    errors = page.locator(
        ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']:has-text('Error')"
    )
    assert errors.count() == 0, errors.first.inner_text()[:2000]


def _reload(page) -> None:
    """Save the notebook (its outputs name the widget models), reload, reconnect the kernel."""
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    page.wait_for_function(
        "() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=60_000
    )
    page.reload(timeout=120_000)
    _wait_kernel(page)


def _check_scaler(page, tmp_path: Path, when: str) -> None:
    widget = page.locator(".jp-OutputArea-output:has(.widget-button:text-is('Overflow step'))")
    try:
        widget.first.wait_for(timeout=120_000)
    except Exception:
        page.screenshot(path=str(tmp_path / f"failure-{when}.png"))
        raise
    widget = widget.first
    widget.scroll_into_view_if_needed()
    plots = widget.locator(".js-plotly-plot")
    plots.nth(1).wait_for(timeout=60_000)
    assert plots.count() == 2, f"{when}: {plots.count()} plots"
    hist, timeline = plots.nth(0), plots.nth(1)
    assert "fp16 range" in (hist.locator(".gtitle").first.text_content() or "")
    # the two range bands (normal, subnormal) are drawn, and the bars
    assert hist.locator(".shapelayer path").count() >= 2, f"{when}: no fp16 range bands"
    assert hist.locator(".bars path").count() > 10, f"{when}: no histogram bars"
    # the notebook stepped the scaler: the timeline holds its points, not a placeholder
    assert timeline.locator(".scatterlayer .points path").count() >= 10, f"{when}: no timeline"
    assert "press Step" not in widget.inner_text()
    _shot(widget, tmp_path, f"scaler-explorer-{when}")


def _check_saved_view(page, tmp_path: Path) -> None:
    """The profile widget drawn from the notebook's saved state (not bound to the kernel):
    the tab it was saved on, Precision, shows its map and its tables."""
    widget = page.locator(".jp-OutputArea-output:has(.lm-TabBar-tab:has-text('Precision'))")
    widget = widget.first
    panel = widget.locator(".widget-tab-contents > .lm-Widget:not(.lm-mod-hidden)").first
    panel.locator("text=Share of FLOPs and bytes per dtype").first.wait_for(timeout=30_000)
    assert panel.locator(".js-plotly-plot").count() >= 1, "the saved view draws no map"
    assert panel.locator("table.mpnb-table").count() >= 1, "the saved view shows no table"
    _shot(widget, tmp_path, "profile-saved-view")


def _check_profile(page, tmp_path: Path, when: str) -> None:
    widget = page.locator(".jp-OutputArea-output:has(.lm-TabBar-tab:has-text('Precision'))")
    widget.first.wait_for(timeout=120_000)
    widget = widget.first
    widget.scroll_into_view_if_needed()
    assert "thread(s)" in widget.inner_text()
    for tab, check in (
        ("Phases", ".js-plotly-plot .bars path"),
        ("Memory", ".js-plotly-plot .bars path"),
        ("FLOPs", ".js-plotly-plot .bars path"),
        ("Precision", "table.mpnb-table"),
        ("Overflow", ".widget-button:has-text('Precision tab')"),
    ):
        select_tab(widget, tab)
        panel = widget.locator(".widget-tab-contents > .lm-Widget:not(.lm-mod-hidden)").first
        try:
            panel.locator(check).first.wait_for(state="attached", timeout=60_000)
        except Exception:
            widget.screenshot(path=str(tmp_path / f"failure-{tab}-{when}.png"))
            (tmp_path / f"failure-{tab}-{when}.html").write_text(widget.inner_html())
            raise
        assert panel.locator(check).count() >= 1, f"{when}: {tab} is blank"
        text = panel.inner_text()
        assert "press Run" not in text and "not measured" not in text, f"{when}: {tab}"
        _shot(widget, tmp_path, f"profile-{tab.lower()}-{when}")
    # the overflow finder's link opens the Precision tab
    widget.locator(".widget-button:has-text('Precision tab')").first.click()
    panel = widget.locator(".widget-tab-contents > .lm-Widget:not(.lm-mod-hidden)").first
    panel.locator("text=Share of FLOPs and bytes per dtype").first.wait_for(timeout=30_000)


@pytest.mark.parametrize(
    "notebook, last_text, check",
    [
        ("04_loss_scaling_and_overflow.ipynb", "simulated: skipped steps", _check_scaler),
        ("07_profiler.ipynb", "trace events written", _check_profile),
    ],
    ids=["scaler-explorer", "profile"],
)
def test_widget_charts_after_run_all_and_after_reload(tmp_path, notebook, last_text, check):
    with serve_lab(tmp_path, ROOT / "notebooks" / notebook) as (base, token), chromium() as b:
        page, errors = _open(b, base, token, notebook)
        _run_all(page, last_text)
        check(page, tmp_path, "run-all")
        _reload(page)
        try:
            check(page, tmp_path, "reload")
        except StaticWidget:
            # The reloaded page drew the widget from the notebook's saved state before its
            # kernel connection could hand ipywidgets the live models (seen 2 in 5 runs): the
            # tabs cannot switch there. A user reloads again; so does the test, once.
            _reload(page)
            try:
                check(page, tmp_path, "reload-again")
            except StaticWidget:  # static again (seen 1 in 10): what it shows must still draw
                _check_saved_view(page, tmp_path)
    assert not errors, "\n".join(errors)
