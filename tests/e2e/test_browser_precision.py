"""In a real browser: the pictures of the profile widget's Precision tab, and nothing cut.

A small notebook profiles a two-layer model with long module names; headless Chromium runs
it in JupyterLab (the server and helpers of :mod:`test_browser` and
:mod:`test_browser_views`) and opens the Precision tab, where

* both pictures are drawn: the module x phase map of the O1 trace and the statistics map
  (what NVFP4 would do to O1's tensors), each a plotly SVG of non-zero size holding its
  heat map, with every module and layer on its axis;
* no label is cut: every description, label and button shows its whole text (its
  ``scrollWidth`` within its ``clientWidth``: "configuration" was cut to "configurat..."),
  and every map's title and axis labels lie inside its SVG;
* the detail column of "Every op" keeps each op on few lines (it wrapped to four);

and after choosing ``nvfp4`` and pressing Trace, the map shows NVFP4 and the statistics are
NVFP4's own (the what-if chooser hidden). Screenshots go to ``out/browser-views`` (or
``MPNB_SHOTS``).
"""

from __future__ import annotations

import re

import pytest

from .test_browser import chromium, serve_lab
from .test_browser_views import _box, _close, _notebook, _open, _shot, _tab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

_CELLS = [
    "import torch\n"
    "import mpnb.widgets\n\n"
    "torch.set_num_threads(1)\n"
    "x = torch.randn(32, 32, generator=torch.Generator().manual_seed(0))\n\n\n"
    "class Block(torch.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.attention_projection = torch.nn.Linear(32, 64)\n"
    "        self.layer_norm = torch.nn.LayerNorm(64)\n"
    "        self.classifier_head = torch.nn.Linear(64, 4)\n\n"
    "    def forward(self, x):\n"
    "        return self.classifier_head(torch.relu(self.layer_norm(\n"
    "            self.attention_projection(x))))",
    "torch.manual_seed(0)\n"
    "pw = mpnb.widgets.profile(Block(), x, opt_levels=('O0', 'O1'), steps=1, memory=False,\n"
    "    trace=False, threads=1)\n"
    "pw.show_precision()\npw",
    "assert pw.errors.last_error is None, pw.errors.last_error\nprint('widget ready')",
]
_LINEARS = ("attention_projection", "classifier_head")

# every text a person reads in the tab: its box must hold its whole text
_LABELS = ".widget-label, .widget-label-basic, label, .widget-button, .widget-html-content b"
_CUT = """root => [...root.querySelectorAll(sel)]
    .filter(e => e.offsetParent !== null && e.textContent.trim())
    .filter(e => e.scrollWidth > e.clientWidth + 1)
    .map(e => `${e.textContent.trim()}: ${e.scrollWidth} > ${e.clientWidth}`)"""
# every title and axis label of a plot inside its SVG
_OUTSIDE = """plot => { const svg = plot.querySelector('svg.main-svg').getBoundingClientRect();
    return [...plot.querySelectorAll('.gtitle, .xtick text, .ytick text, .cbaxis text')]
        .filter(t => t.textContent.trim())
        .filter(t => { const r = t.getBoundingClientRect();
            return r.left < svg.left - 1 || r.right > svg.right + 1 || r.top < svg.top - 1; })
        .map(t => t.textContent); }"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab over the notebook above and a Chromium, as :func:`_open` takes them."""
    src = tmp_path_factory.mktemp("src") / "precision.ipynb"
    src.write_text(_notebook(_CELLS))
    with serve_lab(tmp_path_factory.mktemp("precision"), src) as (base, token), chromium() as b:
        yield dict(base=base, token=token, browser=b)


_DRAWN = """([root, titles]) => titles.every(t => [...root.querySelectorAll('.js-plotly-plot')]
    .some(p => new RegExp(t).test(p.querySelector('.gtitle')?.textContent || '')
        && p.querySelector('.hm image')))"""


def _plots(page, panel, titles: tuple[str, str], shot: str):
    """The two maps of the open Precision tab, once drawn with titles matching ``titles``
    (regular expressions); a screenshot ``shot`` first if they never come."""
    try:
        page.wait_for_function(_DRAWN, arg=[panel.element_handle(), list(titles)], timeout=120_000)
    except Exception:
        _shot(panel, f"failure-{shot}")
        raise
    plots = panel.locator(".js-plotly-plot").all()
    title = [p.locator(".gtitle").first.text_content() or "" for p in plots]
    return [next(p for p, s in zip(plots, title, strict=True) if re.search(t, s)) for t in titles]


def _read(plot) -> dict:
    svg = plot.locator("svg.main-svg").first
    return dict(
        box=_box(svg),
        heatmaps=plot.locator(".hm image").count(),
        y=plot.locator(".ytick text").all_text_contents(),
        outside=plot.evaluate(_OUTSIDE),
        title=plot.locator(".gtitle").first.text_content(),
    )


def _cut(panel) -> list[str]:
    return panel.evaluate(_CUT.replace("sel", repr(_LABELS)))


def test_precision_tab_draws_both_pictures_and_cuts_no_label(lab):
    page, errors = _open(lab, "precision.ipynb")
    try:
        widget = page.locator(".jp-OutputArea-output:has(.lm-TabBar-tab:has-text('Precision'))")
        widget = widget.first
        widget.scroll_into_view_if_needed()
        panel = _tab(widget, "Precision")
        o1 = [
            _read(p) for p in _plots(page, panel, ("^O1: format per module", "what-if nvfp4"), "o1")
        ]
        page.wait_for_timeout(500)
        _shot(widget, "precision-o1")
        cut_o1 = _cut(panel)
        pane = _box(panel)
        columns = [_box(h) for h in panel.locator("table.mpnb-table th").all() if h.is_visible()]
        rows = [_box(r) for r in panel.locator("table.mpnb-table").last.locator("tbody tr").all()]
        line = _box(panel.locator("table.mpnb-table td").first)["height"]
        what_if = panel.locator(".widget-dropdown:has(label:text-is('what if'))").first

        panel.locator(".widget-dropdown:has(label:text-is('configuration')) select").select_option(
            "nvfp4"
        )
        panel.locator(".widget-button:text-is('Trace')").click()
        own = [
            _read(p)
            for p in _plots(
                page, panel, ("^nvfp4.*: format per module", "nvfp4.*as this step"), "nvfp4"
            )
        ]
        page.wait_for_timeout(500)
        _shot(widget, "precision-nvfp4")
        cut_nvfp4 = _cut(panel)
        what_if_shown = what_if.is_visible()
    finally:
        _close(page)
    for name, (trace_map, stats_map) in (("O1", o1), ("nvfp4", own)):
        for what, m in (("map", trace_map), ("statistics", stats_map)):
            assert m["box"]["width"] > 200 and m["box"]["height"] > 200, (name, what, m)
            assert m["heatmaps"] >= 1, f"{name}: the {what} picture has no heat map: {m}"
            assert not m["outside"], f"{name}: {what} text outside its picture: {m['outside']}"
        for layer in _LINEARS:  # a row per linear layer in both maps
            assert layer in trace_map["y"] and layer in stats_map["y"], (name, trace_map["y"])
        assert "layer_norm" in trace_map["y"], trace_map["y"]
        # side by side, and the statistics map does not run off the pane
        assert stats_map["box"]["x"] >= trace_map["box"]["right"] - 1, (trace_map, stats_map)
    assert not cut_o1 and not cut_nvfp4, f"labels cut: {cut_o1 + cut_nvfp4}"
    assert columns and all(th["right"] <= pane["right"] + 1 for th in columns), (pane, columns)
    assert o1[1]["box"]["right"] <= pane["right"] + 1, (pane, o1[1]["box"])
    assert rows, "no row in 'Every op'"
    tall = [r["height"] for r in rows if r["height"] > 2.5 * line]
    assert not tall, f"{len(tall)} of {len(rows)} ops wrap past two lines: {tall[:5]}"
    assert not what_if_shown, "nvfp4 has its own statistics: the what-if chooser must hide"
    assert not errors, errors
