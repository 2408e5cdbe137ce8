"""End to end in a real browser: JupyterLab on loopback, the opt-level notebook, the Run button.

Starts JupyterLab on 127.0.0.1 (a free port, a random token) over a temporary copy of
``notebooks/03_opt_levels.ipynb``, opens it in Debian's headless Chromium driven by Python
playwright, runs every cell, clicks Run in the CompareWidget (the default workload, a small
GPT), waits until the Speed chart and the Table tab show every configuration, and checks that
the verdict and a chart title are visible, that no error shows in the widget, that after a
save and a page reload the chart is drawn again from the kernel's widget state, and that
the browser console logged no error. A screenshot of the widget is saved in the test's temporary
directory, and to ``docs/img/compare-widget.png`` when ``MPNB_UPDATE_SCREENSHOT=1``.

Chromium comes from ``scripts/setup-browser.sh`` (never ``playwright install``). Without it
the test skips, except in CI (``CI=true``), where it fails. Every wait is bounded and the
server is always stopped.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "03_opt_levels.ipynb"
SCREENSHOT = ROOT / "docs" / "img" / "compare-widget.png"
CHROMIUM = os.environ.get("MPNB_CHROMIUM", "/usr/bin/chromium")
CONFIGS = ["O0 fp32 b16", "O1 bf16 b16", "O2 bf16 b16", "O3 bf16 b16"]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _require(ok: bool, why: str) -> None:
    if ok:
        return
    if IN_CI:
        pytest.fail(f"{why} (CI=true: the browser test must run; see scripts/setup-browser.sh)")
    pytest.skip(why)


@contextlib.contextmanager
def chromium():
    """A headless Chromium driven by playwright, closed on exit (the test is skipped, or fails
    under ``CI=true``, when Chromium or playwright is missing)."""
    _require(Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: run scripts/setup-browser.sh")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _require(False, "playwright is not installed (pip install -e '.[dev]')")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield browser
        finally:
            browser.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"jupyter lab did not answer {url} within {timeout:.0f} s")


@contextlib.contextmanager
def serve_lab(tmp_path: Path, notebook: Path):
    """A JupyterLab server on 127.0.0.1 over a copy of ``notebook``; yields (url, token)."""
    shutil.copy(notebook, tmp_path / notebook.name)
    # no "Would you like to get notified about Jupyter news?" toast over the widget
    labconfig = tmp_path / "config" / "labconfig"
    labconfig.mkdir(parents=True)
    (labconfig / "page_config.json").write_text(
        '{"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": true}}'
    )
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
    )
    cmd = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--no-browser",
        "--allow-root",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={tmp_path}",
        "--LabApp.expose_app_in_browser=True",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_http(f"{base}/api/status?token={token}", proc, timeout=90)
        yield base, token
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server over a copy of the opt-level notebook; yields (url, token)."""
    with serve_lab(tmp_path, NOTEBOOK) as served:
        yield served


class StaticWidget(AssertionError):
    """A widget's tab would not switch: the page shows the widget from the notebook's saved
    state, not bound to the kernel's model (after a reload, when ipywidgets could not load the
    models from the kernel in time: its "Error displaying widget: model not found")."""


def select_tab(widget, tab: str) -> None:
    """Click ``tab`` until the tab bar shows it current: after a reload the widget's restored
    state (the tab selected when the notebook was saved) can land after a first click.

    Raises:
        StaticWidget: it never became current (the widget is not bound to the kernel)."""
    current = widget.locator(f".lm-TabBar-tab.lm-mod-current:has-text('{tab}')").first
    for _ in range(5):
        widget.locator(f".lm-TabBar-tab:has-text('{tab}')").first.click()
        try:
            current.wait_for(state="attached", timeout=5_000)
            widget.page.wait_for_timeout(500)  # a late restore would switch it back now
            if current.count():
                return
        except Exception:  # noqa: BLE001, S112 - not current yet: click again
            continue
    tabs = widget.locator(".lm-TabBar-tab")
    seen = [(t.inner_text(), t.get_attribute("class")) for t in tabs.all()]
    raise StaticWidget(f"the {tab!r} tab never became current after 5 clicks; tabs: {seen}")


def _wait_kernel(page) -> None:
    page.wait_for_function(
        "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
        " && window.jupyterapp.shell.currentWidget.sessionContext"
        " && window.jupyterapp.shell.currentWidget.sessionContext.session"
        " && window.jupyterapp.shell.currentWidget.sessionContext.session"
        ".kernel",
        timeout=120_000,
    )


def _run_all_and_wait(page, timeout_ms: int, last_text: str = "history rows") -> None:
    _wait_kernel(page)
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    # the last cell prints ``last_text`` once everything above it has passed
    page.locator(f".jp-OutputArea-output pre:has-text('{last_text}')").first.wait_for(
        timeout=timeout_ms
    )
    errors = page.locator(
        ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']:has-text('Error')"
    )
    assert errors.count() == 0, errors.first.inner_text()[:2000]


_WATCH_DISABLED = """b => {
    window.__mpnbRunStarted = false;
    new MutationObserver(() => { if (b.disabled) window.__mpnbRunStarted = true; })
        .observe(b, {attributes: true, attributeFilter: ["disabled"]});
}"""


def test_opt_level_notebook_and_widget_in_chromium(lab, tmp_path):
    base, token = lab
    console_errors: list[str] = []
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1500, "height": 2000})
        page.on("console", lambda m: m.type == "error" and console_errors.append(m.text))
        page.on("pageerror", lambda e: console_errors.append(f"pageerror: {e}"))
        page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}", timeout=120_000)
        _run_all_and_wait(page, timeout_ms=300_000)

        run = page.locator(".widget-button:text-is('Run')").first
        run.wait_for(timeout=60_000)
        run.scroll_into_view_if_needed()
        # A short run can disable and re-enable the button between two polls: record
        # every change of its `disabled` attribute from before the click instead.
        handle = run.element_handle()
        page.evaluate(_WATCH_DISABLED, handle)
        run.click()
        page.wait_for_function("() => window.__mpnbRunStarted === true", timeout=60_000)
        page.wait_for_function("b => !b.disabled", arg=handle, timeout=400_000)
        widget = page.locator(".jp-OutputArea-output:has(.widget-button:text-is('Run'))")
        widget.get_by_text("done: 4 configurations").wait_for(timeout=30_000)

        # the Speed chart (plotly) has one bar per configuration, labelled on the x axis
        try:
            for name in CONFIGS:
                widget.locator(f".js-plotly-plot .xtick text:text-is('{name}')").first.wait_for(
                    timeout=60_000
                )
        except Exception:
            widget.screenshot(path=str(tmp_path / "failure.png"))  # what the user saw
            (tmp_path / "console.txt").write_text("\n".join(console_errors))
            raise
        bars = widget.locator(".js-plotly-plot .bars path").count()
        assert bars >= len(CONFIGS), f"speed chart shows {bars} bars"
        verdict = widget.locator(".mpnb-verdict").first
        assert verdict.is_visible() and verdict.inner_text().startswith("Verdict:")
        title = widget.locator(".js-plotly-plot .gtitle").first
        assert title.is_visible() and "Speed vs O0" in (title.text_content() or "")
        text = widget.inner_text()
        for bad in ("failed:", "Traceback", "Error:"):
            assert bad not in text, f"the widget shows {bad!r}: {text[:2000]}"
        widget.scroll_into_view_if_needed()
        shot = tmp_path / "compare-widget.png"
        widget.screenshot(path=str(shot))

        widget.locator(".lm-TabBar-tab:has-text('Table')").first.click()
        table = widget.locator("table.mpnb-table").first  # speed and memory (then accuracy)
        table.wait_for(timeout=30_000)
        text = table.inner_text()
        for name in CONFIGS:
            assert name in text, f"{name} missing from the table"

        # after a reload the charts are rebuilt from the kernel's widget state
        page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
        page.wait_for_function(
            "() => !window.jupyterapp.shell.currentWidget.context.model.dirty",
            timeout=60_000,
        )
        page.reload(timeout=120_000)
        _wait_kernel(page)
        widget = page.locator(".jp-OutputArea-output:has(.widget-button:text-is('Run'))")
        widget.first.wait_for(timeout=120_000)
        widget = widget.first
        select_tab(widget, "Speed")  # Table was open when the notebook was saved
        for name in CONFIGS:
            widget.locator(f".js-plotly-plot .xtick text:text-is('{name}')").first.wait_for(
                timeout=60_000
            )
        assert widget.locator(".js-plotly-plot .bars path").count() >= len(CONFIGS)
        widget.scroll_into_view_if_needed()
        reloaded = tmp_path / "compare-widget-reload.png"
        widget.screenshot(path=str(reloaded))
    assert shot.stat().st_size > 10_000
    if os.environ.get("MPNB_SHOTS"):
        for png in (shot, reloaded):
            Path(os.environ["MPNB_SHOTS"]).mkdir(parents=True, exist_ok=True)
            shutil.copy(png, Path(os.environ["MPNB_SHOTS"]) / png.name)
    if os.environ.get("MPNB_UPDATE_SCREENSHOT") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, SCREENSHOT)
    assert not console_errors, "browser console errors:\n" + "\n".join(console_errors)
