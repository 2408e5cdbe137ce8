"""``mpnb.lab.html_report``: the HTML report (every chart, offline), its table, glossary and
banner, and a report written whole or not at all."""

from __future__ import annotations

import pytest
from torch import nn

import mpnb.lab
from mpnb.lab import workloads
from mpnb.lab.html_report import CHARTS

from .test_runner import _data, _Fragile


@pytest.fixture(scope="module")
def df():
    w = workloads.custom(
        _Fragile,
        _data(),
        nn.functional.cross_entropy,
        workloads.accuracy,
        metric_name="accuracy",
        batch_size=16,
    )
    return mpnb.lab.compare(w, steps=6, progress=False, threads=1)  # O2/O3 are error rows


def test_report_is_self_contained_with_every_chart(df, tmp_path):
    path = mpnb.lab.report(df, tmp_path / "r.html")
    page = path.read_text()
    for name in CHARTS:
        assert f'id="chart-{name}"' in page and f'id="plot-{name}"' in page
    from plotly.offline import get_plotlyjs

    js = get_plotlyjs()
    assert js in page  # plotly.js is inlined; nothing else is loaded from anywhere
    rest = page.replace(js, "")
    assert "<script src=" not in rest and "http" not in rest.replace("https://plot.ly", "")
    assert "Plotly.newPlot" in rest
    assert df.attrs["hardware"]["summary"].split(";")[0] in page
    assert "planted failure" in page  # the error rows are in the table
    for cfg in df.configuration:
        assert cfg in page


def test_numbers_read_as_numbers():
    from mpnb.lab.html_report import format_value

    assert format_value("samples_per_s", 66340.2) == "66,340"
    assert format_value("mem_saving_vs_O0", -3.387e-05) == "0%"
    assert format_value("mem_saving_vs_O0", 0.176) == "+18%"
    assert format_value("speedup_vs_O0", 0.5812) == "0.58"
    assert format_value("final_loss_scale", 65536.0) == "65,536"
    assert format_value("step_time_ms", 12.345) == "12.3"
    assert format_value("final_loss", float("nan")) == "-"


def test_one_warnings_banner_compact_rows_glossary_and_distinct_curves(df, tmp_path):
    import html
    import re

    from mpnb.core.precision_configs import PRECISION_CONFIGS
    from mpnb.lab.html_report import TABLE_COLUMNS, figures, warnings_banner

    noisy = df.copy()
    noisy.attrs = df.attrs
    noisy["warnings"] = "bf16 is emulated on this CPU"
    banner = warnings_banner(noisy)
    assert banner == ["bf16 is emulated on this CPU (all configurations)"]
    page = mpnb.lab.report(noisy, tmp_path / "r.html").read_text()
    body = page.split("<h2>Results</h2>")[1].split("<h2>Charts</h2>")[0]
    assert body.count("bf16 is emulated on this CPU") == 1  # once, not on every row
    table = body.split("<table")[1].split("</table>")[0]
    for header in ("throughput (samples/s)", "peak memory (MiB)", "step time (ms)"):
        assert header in table
    assert "e+0" not in table and "e-0" not in table  # no 6.634e+04, no -3.387e-05
    cells = re.findall(r"<td>(.*?)</td>", table)
    assert cells and max(len(c) for c in cells) <= 90  # compact rows: no paragraph in a cell
    assert "warnings" not in TABLE_COLUMNS
    glossary = page.split("Glossary")[1]
    for name, cfg in PRECISION_CONFIGS.items():
        assert name in glossary and html.escape(cfg.description) in glossary
    curves = figures(df)["loss"].data
    styles = {(t.line.dash, t.marker.symbol) for t in curves}
    assert len(styles) == len(curves) and all("markers" in t.mode for t in curves)


def test_report_rejects_a_foreign_frame(tmp_path):
    import pandas as pd

    with pytest.raises(ValueError, match="compare"):
        mpnb.lab.report(pd.DataFrame({"a": [1]}), tmp_path / "r.html")


def test_the_glossary_describes_a_keep_list_row_with_its_keep_list():
    import html

    from mpnb.core.precision_configs import get_config
    from mpnb.lab.html_report import glossary_html

    page = glossary_html(["nvfp4:keep-last=1", "a row of my own", "O2"])
    kept = get_config("nvfp4:keep-last=1")
    assert page.index("nvfp4:keep-last=1") < page.index("<b>O2</b>") < page.index("<b>O0</b>")
    assert (
        html.escape(kept.description) in page
        and kept.description != get_config("nvfp4").description
    )
    assert "a row of my own" not in page


def _tiny():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def test_a_report_write_that_fails_half_way_keeps_the_previous_report(tmp_path, file_size_limit):
    """A file system filling up mid-write truncated the previous report to the part written."""
    w = workloads.custom(_tiny, _data(), nn.functional.cross_entropy, batch_size=16)
    df = mpnb.lab.compare(w, opt_levels=("O0",), steps=4, progress=False, threads=1)
    path = tmp_path / "report.html"
    previous = "<html>the previous report</html>"
    path.write_text(previous)
    with file_size_limit(100_000), pytest.raises(OSError, match="previous content is kept"):
        mpnb.lab.report(df, path)
    assert path.read_text() == previous
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no temporary file left
    mpnb.lab.report(df, path)  # with room, the new report replaces it
    assert "plotly" in path.read_text()
