"""In a real browser: the compare and profile views read as a person reads them.

One JupyterLab server (from :mod:`test_browser`) serves small notebooks written by the tests;
headless Chromium opens them, clicks as a user would and checks what is on the screen:

1. **Stop keeps the truth**: after Stop (two batch sizes, three opt levels) the verdict speaks
   of what was measured, every configuration of both batch sizes has a row that says what
   happened to it, the Accuracy tab is not an empty chart and the status line is not cut off.
2. **Errors beside their cause**: an Export error shows by the export buttons, a failed
   configuration by the Run button, both above the charts, and a later success clears them.
3. **Input errors keep the layout**: three bad controls at once, at 900 px and 1400 px: every
   message readable on a few lines, every control whole.
4. **Tables that fit**: the report's results tables inside its 1200 px page, and the profile
   widget's Memory and Precision tables, show their columns without sideways scrolling.
5. **One reading of speed**: the Table tab says how its step times relate to the speed figure
   (and where they disagree), the report's speed labels sit clear of the whiskers and its
   header names the steps that ran.

Every state checked is saved as a PNG (paths printed; ``out/browser-views`` or
``MPNB_SHOTS``) before the assertions, so a failing run still shows what the user saw.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .test_browser import ROOT, _wait_kernel, chromium, serve_lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SHOTS = Path(os.environ.get("MPNB_SHOTS") or ROOT / "out" / "browser-views")

# A tiny classifier on random data: every step takes milliseconds, even on a busy machine.
_SETUP = """\
import torch
import mpnb.lab
import mpnb.widgets

torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
x = torch.randn(512, 32, generator=g)
y = (x[:, 0] > 0).long()


def model():
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)
    )
"""

NOTEBOOKS = {
    "stop.ipynb": [
        _SETUP,
        "cw = mpnb.widgets.compare(model, (x, y), metric_fn=mpnb.lab.accuracy,\n"
        "    opt_levels=('O0', 'O1', 'O2'), batch_sizes=(16, 32), steps=400, threads=1)\n"
        "cw.controls.selected_index = None  # controls folded: the results in view\ncw",
        "print('widget ready')",
    ],
    "errors.ipynb": [
        _SETUP,
        "cw = mpnb.widgets.compare(model, (x, y), metric_fn=mpnb.lab.accuracy,\n"
        "    opt_levels=('O0', 'O3'), half_dtype='fp16', loss_scale=2.0**24, steps=4,\n"
        "    threads=1)\ncw.export_path.value = 'views-export'\n"
        "cw.controls.selected_index = None\ncw",
        "print('widget ready')",
    ],
    "inputs.ipynb": [
        _SETUP,
        "cw = mpnb.widgets.compare(model, (x, y), steps=4, threads=1)\ncw",
        "print('widget ready')",
    ],
    "profile.ipynb": [
        _SETUP,
        "class Block(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.attention_projection = torch.nn.Linear(32, 64)\n"
        "        self.layer_norm = torch.nn.LayerNorm(64)\n"
        "        self.classifier_head = torch.nn.Linear(64, 2)\n\n"
        "    def forward(self, x):\n"
        "        return self.classifier_head(torch.relu(self.layer_norm(\n"
        "            self.attention_projection(x))))\n\n\n"
        "pw = mpnb.widgets.profile(Block(), x[:64], opt_levels=('O0', 'O1', 'O2', 'O3'),\n"
        "    steps=2, threads=1)\npw",
        "print('widget ready')",
    ],
    "speed.ipynb": [
        _SETUP,
        "cw = mpnb.widgets.compare(model, (x, y), metric_fn=mpnb.lab.accuracy,\n"
        "    opt_levels=('O0', 'O3'), steps=12, threaded=False, threads=1)\n"
        "cw.run()\n"
        "# What a machine whose load changed between rounds gives: O3's own median step\n"
        "# time far from what its per-round ratios (the speed figure) say.\n"
        "df = cw.df.copy()\n"
        "df.attrs = dict(cw.df.attrs)\n"
        "low = df.loc[1, 'speedup_lo']\n"
        "df.loc[1, 'step_time_ms'] = 2.0 * df.loc[0, 'step_time_ms'] / low\n"
        "cw.df = df\ncw.controls.selected_index = None\ncw",
        "print('widget ready')",
    ],
}


def _notebook(cells: list[str]) -> str:
    nb = dict(
        cells=[
            dict(cell_type="code", execution_count=None, metadata={}, outputs=[], source=src)
            for src in cells
        ],
        metadata=dict(kernelspec=dict(display_name="Python 3", language="python", name="python3")),
        nbformat=4,
        nbformat_minor=5,
    )
    return json.dumps(nb)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """One JupyterLab server over a folder holding every notebook above; yields its state."""
    root = tmp_path_factory.mktemp("views")
    src = tmp_path_factory.mktemp("src") / "stop.ipynb"
    src.write_text(_notebook(NOTEBOOKS["stop.ipynb"]))
    # every cell rendered, also off screen (JupyterLab's default hides cells out of view)
    settings = tmp_path_factory.mktemp("settings")
    tracker = settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text('{"windowingMode": "none"}')
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTERLAB_SETTINGS_DIR", str(settings))
        with serve_lab(root, src) as (base, token), chromium() as browser:
            for name, cells in NOTEBOOKS.items():
                (root / name).write_text(_notebook(cells))
            yield dict(base=base, token=token, root=root, browser=browser)


def _open(lab, name: str, width: int = 1400, height: int = 2400):
    """A new page at ``width`` px with ``name`` run to its last cell; returns (page, errors)."""
    page = lab["browser"].new_page(viewport={"width": width, "height": height})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    # ?reset: a fresh workspace, without the notebooks of the tests before
    page.goto(f"{lab['base']}/lab/tree/{name}?reset&token={lab['token']}", timeout=120_000)
    _wait_kernel(page)
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    stderr = ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
    page.locator(f".jp-OutputArea-output pre:has-text('widget ready'), {stderr}").first.wait_for(
        state="attached", timeout=420_000
    )
    failed = page.locator(f"{stderr}:has-text('Error')")
    assert failed.count() == 0, failed.first.inner_text()[:2000]
    return page, errors


def _close(page) -> None:
    """Shut the page's kernels down (each test's notebook has its own), then close it."""
    try:
        page.evaluate(
            "() => window.jupyterapp && window.jupyterapp.serviceManager.sessions.shutdownAll()"
        )
    finally:
        page.close()


def _shot(locator, name: str) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    locator.screenshot(path=str(path))
    print(f"screenshot: {path}")
    return path


def _compare_widget(page):
    widget = page.locator(".jp-OutputArea-output:has(.widget-button:text-is('Run'))").first
    widget.wait_for(timeout=120_000)
    widget.scroll_into_view_if_needed()
    return widget


def _tab(widget, title: str):
    """Open the tab ``title`` of the widget's result tabs; returns its visible panel."""
    widget.locator(f".lm-TabBar-tab:has-text('{title}')").first.click()
    return widget.locator(".widget-tab-contents > .lm-Widget:not(.lm-mod-hidden)").first


def _box(locator) -> dict:
    return locator.evaluate(
        "e => { const r = e.getBoundingClientRect();"
        " return {x: r.x, y: r.y, right: r.right, bottom: r.bottom, width: r.width,"
        " height: r.height, scroll: e.scrollWidth, client: e.clientWidth}; }"
    )


def _finish_run(widget, page, timeout_ms: int = 400_000) -> None:
    run = widget.locator(".widget-button:text-is('Run')").first
    page.wait_for_function("b => !b.disabled", arg=run.element_handle(), timeout=timeout_ms)


def _run_and_wait(widget, page, status: str, shot: str) -> None:
    """Click Run, wait for the status line to start with ``status``, then screenshot."""
    widget.locator(".widget-button:text-is('Run')").first.click()
    widget.locator(f"text=/^{status}/").first.wait_for(timeout=400_000)
    _finish_run(widget, page)
    page.wait_for_timeout(500)
    _shot(widget, shot)


# ---- 1. Stop --------------------------------------------------------------------------------


def test_stop_keeps_every_configuration_and_a_verdict_from_what_was_measured(lab):
    page, errors = _open(lab, "stop.ipynb")
    try:
        widget = _compare_widget(page)
        status = widget.locator(".widget-label:text-is('ready'), .mpnb-status").first
        status = status.element_handle()  # the same element while its text changes
        widget.locator(".widget-button:text-is('Run')").first.click()
        # Stop once a few rounds of the first batch size ran (the status counts the steps)
        page.wait_for_function(
            "e => { const m = /(\\d+)\\/\\d+ steps/.exec(e.textContent);"
            " return m && +m[1] >= 60; }",
            arg=status,
            timeout=300_000,
        )
        widget.locator(".widget-button:text-is('Stop')").first.click()
        widget.locator("text=/^stopped/").first.wait_for(timeout=120_000)
        _finish_run(widget, page)
        _shot(widget, "1-stop-speed")
        verdict = widget.locator(".mpnb-verdict").first.inner_text()
        status_box = status.evaluate(
            "e => ({scroll: e.scrollWidth, client: e.clientWidth, text: e.textContent})"
        )
        status_text = status_box["text"]
        accuracy = _tab(widget, "Accuracy")
        page.wait_for_timeout(500)
        _shot(widget, "1-stop-accuracy")
        acc_text = accuracy.inner_text()
        acc_bars = accuracy.locator(".js-plotly-plot .bars path").count()
        table = _tab(widget, "Table")
        table.locator("table").first.wait_for(timeout=30_000)
        _shot(widget, "1-stop-table")
        rows = table.locator("tbody tr").all_inner_texts()
    finally:
        _close(page)
    assert "every configuration failed" not in verdict, verdict
    assert re.search(r"interrupted after \d+ (of \d+ )?steps", verdict), verdict
    assert "fewer steps than asked" in verdict or "too little was measured" in verdict, verdict
    names = [f"{lvl} b{b}" for b in (16, 32) for lvl in ("O0 fp32", "O1 bf16", "O2 bf16")]
    for name in names:  # every configuration of both batch sizes keeps a row...
        row = next((r for r in rows if r.startswith(name)), None)
        assert row is not None, f"{name} has no row: {rows}"
        assert "interrupted" in row or "not started" in row, row  # ...that says what happened
    assert "6" in status_text and "interrupted" in status_text, status_text
    assert status_box["scroll"] <= status_box["client"] + 1, f"status cut off: {status_box}"
    # no empty axes: bars, or a sentence saying why there is no metric
    assert acc_bars > 0 or "no held-out metric" in acc_text.lower(), acc_text
    assert not errors, errors


# ---- 2. Errors beside their cause ------------------------------------------------------------


def test_errors_show_beside_their_cause_and_a_success_clears_them(lab):
    page, errors = _open(lab, "errors.ipynb")
    try:
        widget = _compare_widget(page)
        export = widget.locator(".widget-button:has-text('Export CSV')").first
        export.click()
        err = widget.locator("text=/nothing to export yet/").first
        err.wait_for(timeout=60_000)
        _shot(widget, "2-errors-export-before-run")
        export_box, err_box = _box(export), _box(err)
        tabs_box = _box(widget.locator(".lm-TabBar").first)
        _run_and_wait(widget, page, "done", "2-errors-failed-configuration")
        stale = widget.locator("text=/nothing to export yet/ >> visible=true").count()
        failed = widget.locator("text=/O3 fp16 b\\d+.*failed/ >> visible=true").first
        failed.wait_for(timeout=30_000)
        failed_box, run_box = _box(failed), _box(widget.locator(".widget-button:text-is('Run')"))
        tabs_box2 = _box(widget.locator(".lm-TabBar").first)
        # a successful run (O0 alone) clears the failure
        widget.locator(".jupyter-widget-Collapse-header").first.click()  # unfold the controls
        select = widget.locator(".widget-select-multiple select").first
        select.select_option(["O0"])
        widget.locator(".jupyter-widget-Collapse-header").first.click()
        _run_and_wait(widget, page, "done: 1 configuration", "2-errors-after-success")
        left = widget.locator("text=/NaN divergence/ >> visible=true").count()
    finally:
        _close(page)
    # the export error sits by the export buttons, above the charts
    assert err_box["bottom"] <= tabs_box["y"], (err_box, tabs_box)
    assert abs(err_box["y"] - export_box["bottom"]) < 120, (err_box, export_box)
    assert stale == 0, "the export error stayed after a successful run"
    # the failed configuration is named above the charts, near the Run button
    assert failed_box["bottom"] <= tabs_box2["y"], (failed_box, tabs_box2)
    assert failed_box["y"] - run_box["bottom"] < 200, (failed_box, run_box)
    assert left == 0, "the failed configuration's error stayed after a successful run"
    assert not errors, errors


# ---- 3. Input errors -------------------------------------------------------------------------


def _input(widget, label: str):
    return widget.locator(f".widget-inline-hbox:has(label:text-is('{label}'))").first


@pytest.mark.parametrize("width", [900, 1400])
def test_bad_inputs_keep_every_message_and_control_readable(lab, width):
    page, errors = _open(lab, "inputs.ipynb", width=width)
    try:
        widget = _compare_widget(page)
        _input(widget, "opt levels").locator("select").select_option([])
        _input(widget, "loss scale").locator("select").select_option("dynamic")
        for label, value in (("growth", "0.1"), ("threads", "-1")):
            box = _input(widget, label).locator("input")
            box.fill(value)
            box.press("Enter")
        messages = widget.locator("span:has-text('⚠')")
        page.wait_for_function(
            "n => document.querySelectorAll('span').length && "
            "[...document.querySelectorAll('span')].filter(s => s.textContent.includes('⚠'))"
            ".length >= n",
            arg=3,
            timeout=60_000,
        )
        page.wait_for_timeout(500)
        _shot(widget.locator(".jupyter-widget-Accordion").first, f"3-inputs-{width}px")
        boxes = [
            (
                m.inner_text(),
                _box(m),
                _box(m.locator("xpath=ancestor::div[contains(@class, 'widget-html')][1]")),
            )
            for m in messages.all()
        ]
        panel_box = _box(widget.locator(".jupyter-widget-Collapse-contents").first)
        columns = [
            _box(c)
            for c in widget.locator(
                ".jupyter-widget-Collapse-contents .widget-hbox > .widget-vbox"
            ).all()
        ]
        controls = [
            (label, _box(_input(widget, label)))
            for label in (
                "opt levels",
                "growth",
                "threads",
                "backoff",
                "initial scale",
                "static scale",
                "loss scale",
                "batch sizes",
                "workload",
            )
        ]
    finally:
        _close(page)
    texts = " ".join(t for t, _, _ in boxes)
    for key in ("at least one opt level", "growth 0.1", "threads -1"):
        assert key in texts, f"{key!r} missing from the messages: {texts}"
    for text, b, holder in boxes:
        words = len(text.split())
        lines = b["height"] / 16
        # readable: at least five words a line on average, nothing cut off sideways
        assert b["height"] > 0 and b["width"] > 0, f"{text!r} is not shown: {b}"
        assert lines <= max(1.5, words / 5), f"{text!r} wraps into {lines:.0f} lines: {b}"
        assert holder["scroll"] <= holder["client"] + 1, (text, holder)
        assert b["right"] <= panel_box["right"] + 1, (text, b, panel_box)
    for label, b in controls:  # every control whole: not clipped, inside the panel
        assert b["scroll"] <= b["client"] + 1, (label, b)
        assert b["right"] <= panel_box["right"] + 1, (label, b, panel_box)
    assert len(columns) == 3, columns
    for col in columns:  # no column clips its controls
        assert col["scroll"] <= col["client"] + 1, col
        assert col["right"] <= panel_box["right"] + 1, (col, panel_box)
    assert panel_box["scroll"] <= panel_box["client"] + 1, panel_box
    assert not errors, errors


# ---- 4. Tables that fit ----------------------------------------------------------------------


def _tiny_report(path: Path, extra_args: tuple = ()) -> Path:
    code = (
        "import sys, torch, mpnb.lab\n"
        "from mpnb.lab import workloads\n"
        "torch.set_num_threads(1)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.randn(256, 8, generator=g); y = (x[:, 0] > 0).long()\n"
        "w = workloads.custom(lambda: torch.nn.Sequential(torch.nn.Linear(8, 16),\n"
        "    torch.nn.ReLU(), torch.nn.Linear(16, 2)), (x, y), metric_fn=workloads.accuracy,\n"
        "    metric_name='accuracy', batch_size=16, steps=12, name='tiny')\n"
        "df = mpnb.lab.compare(w, opt_levels=('O0', 'O1', 'O2', 'O3', 'bf16-pure+kahan'),\n"
        "    progress=False, threads=1)\n"
        "mpnb.lab.report(df, sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=600)
    return path


def test_report_and_profile_tables_fit_without_scrolling_sideways(lab):
    SHOTS.mkdir(parents=True, exist_ok=True)
    report = _tiny_report(SHOTS / "4-report.html")
    page = lab["browser"].new_page(viewport={"width": 1280, "height": 1000})
    try:
        page.goto(report.as_uri(), timeout=60_000)
        results = page.locator("#results, div:has(> table.rows)").first
        results.wait_for(timeout=30_000)
        _shot(results, "4-report-results")
        tables = [
            (_box(t), t.locator("th").all_inner_texts(), [_box(h) for h in t.locator("th").all()])
            for t in results.locator("table").all()
        ]
        body = _box(page.locator("body"))
    finally:
        _close(page)
    page, errors = _open(lab, "profile.ipynb")
    try:
        widget = page.locator(".jp-OutputArea-output:has(.lm-TabBar-tab:has-text('Precision'))")
        widget = widget.first
        widget.scroll_into_view_if_needed()
        found = {}
        for tab in ("Memory", "Precision"):
            panel = _tab(widget, tab)
            panel.locator("table").first.wait_for(timeout=60_000)
            page.wait_for_timeout(500)
            _shot(widget, f"4-profile-{tab.lower()}")
            pane = _box(panel)
            found[tab] = (
                pane,
                [
                    (t.locator("th").all_inner_texts(), [_box(h) for h in t.locator("th").all()])
                    for t in panel.locator("table").all()
                    if t.is_visible()
                ],
            )
    finally:
        _close(page)
    heads = " ".join(" ".join(h) for _, h, _ in tables)
    for key in ("metric", "final loss", "output difference", "skipped", "loss scale", "error"):
        assert key in heads, f"{key!r} is not a column: {heads}"
    for box, _, ths in tables:
        for th in ths:  # every column starts and ends inside the page: no sideways scroll
            assert th["right"] <= body["right"] + 1, (th, body)
        assert box["right"] <= body["right"] + 1, (box, body)

    for tab, (pane, tabs) in found.items():
        assert tabs, f"{tab}: no table"
        for heads, ths in tabs:
            for name, th in zip(heads, ths, strict=True):
                assert th["right"] <= pane["right"] + 1, f"{tab}: column {name!r} is cut: {th}"
    assert not errors, errors


# ---- 5. One reading of speed -----------------------------------------------------------------


def _overlap(a: dict, b: dict) -> bool:
    apart_x = a["right"] <= b["x"] or b["right"] <= a["x"]
    return not (apart_x or a["bottom"] <= b["y"] or b["bottom"] <= a["y"])


def test_one_reading_of_speed_in_the_table_the_report_and_the_header(lab, tmp_path):
    page, errors = _open(lab, "speed.ipynb")
    try:
        widget = _compare_widget(page)
        panel = _tab(widget, "Table")
        panel.locator("table").first.wait_for(timeout=30_000)
        _shot(widget, "5-speed-table")
        table_text = panel.inner_text()
    finally:
        _close(page)
    # the table says how its step times relate to the speed figure, and where they disagree
    assert "median of the per-round ratios" in table_text, table_text
    assert re.search(r"O3 bf16 b\d+: its step time gives [\d.]+x .* the rounds", table_text), (
        table_text
    )

    out = tmp_path / "cli-report.html"
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpnb",
            "compare",
            "--workload",
            "mlp",
            "--steps",
            "6",
            "--opt-levels",
            "O0,O1,O3",
            "--threads",
            "1",
            "--no-progress",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert cli.returncode == 0, cli.stderr
    header = cli.stdout.split("\n\n")[0]
    assert "6 steps" in header and not re.search(r"\b(?!6 )\d+ steps", header), header
    page = lab["browser"].new_page(viewport={"width": 1280, "height": 1000})
    try:
        page.goto(out.as_uri(), timeout=60_000)
        chart = page.locator("#chart-speed")
        chart.locator(".bars path").first.wait_for(timeout=30_000)
        SHOTS.mkdir(parents=True, exist_ok=True)
        top = SHOTS / "5-report-header.png"
        page.screenshot(path=str(top), clip=dict(x=0, y=0, width=1280, height=140))
        print(f"screenshot: {top}")
        _shot(chart, "5-report-speed")
        h1 = page.locator("h1 + p, h1").all_inner_texts()
        labels = [
            _box(t) for t in chart.locator(".bars text, .annotation-text").all() if t.is_visible()
        ]
        whiskers = [_box(p) for p in chart.locator(".errorbar path").all()]
    finally:
        _close(page)
    assert "6 steps" in " ".join(h1) and "60 steps" not in " ".join(h1), h1
    assert labels and whiskers
    for lab_box in labels:
        for wb in whiskers:
            assert not _overlap(lab_box, wb), f"a whisker runs through a label: {lab_box} {wb}"
    assert not errors, errors
