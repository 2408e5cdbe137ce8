"""The HTML report (every chart, offline) and the ``mpnb compare`` command."""

import json

import pytest
from test_lab_runner import _data, _Fragile
from torch import nn

import mpnb.lab
from mpnb.cli import main
from mpnb.lab import workloads
from mpnb.lab.html_report import CHARTS


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
    path = mpnb.lab.report(df, tmp_path / "sub" / "r.html")
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


def test_report_rejects_a_foreign_frame(tmp_path):
    import pandas as pd

    with pytest.raises(ValueError, match="compare"):
        mpnb.lab.report(pd.DataFrame({"a": [1]}), tmp_path / "r.html")


@pytest.mark.slow
def test_cli_compare_prints_the_table_and_writes_the_report(tmp_path, capsys):
    out = tmp_path / "report.html"
    rc = main(
        [
            "compare",
            "--workload",
            "mlp",
            "--opt-levels",
            "O0,O2",
            "--steps",
            "6",
            "--threads",
            "1",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and out.exists()
    assert "O0 fp32 b64" in text and "O2 bf16 b64" in text and "vs O0" in text
    assert "hardware:" in text and "\nVerdict:" in text
    rc = main(
        [
            "compare",
            "--opt-levels",
            "O0",
            "--steps",
            "4",
            "--threads",
            "1",
            "--no-progress",
            "--out",
            "",
            "--json",
        ]
    )
    doc = json.loads(capsys.readouterr().out)  # the default workload: the small GPT
    assert rc == 0 and doc["rows"][0]["configuration"] == "O0 fp32 b16"
    assert doc["workload"]["name"] == "transformer" and doc["workload"]["size"] == "small"


def test_cli_bad_flag_is_a_clear_error(capsys):
    assert main(["compare", "--opt-levels", "O7", "--no-progress", "--out", ""]) == 2
    assert "O7" in capsys.readouterr().err
