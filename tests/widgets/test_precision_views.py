"""The Precision tab's pictures without a browser: a trace or statistics in, a matrix out."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

import mpnb.lab  # noqa: E402
from mpnb.core.number_formats import FORMATS, format_named  # noqa: E402
from mpnb.core.precision_configs import get_config  # noqa: E402
from mpnb.widgets._precision_views import (  # noqa: E402
    OTHER,
    PrecisionPictures,
    default_what_if,
    format_color,
    module_phase_figure,
    module_phase_map,
    ops_table,
    scaled_format,
    stats_figure,
    what_if_choices,
)


def _op(seq, phase, module, dtype, flops=0, nbytes=0, kind="compute", reason="promotion"):
    return dict(
        seq=seq,
        phase=phase,
        module=module,
        kind=kind,
        in_dtypes=dtype,
        dtype=dtype,
        reason=reason,
        detail="why",
        flops=flops,
        bytes=nbytes,
        op="addmm",
    )


def _ops(*rows) -> pd.DataFrame:
    return pd.DataFrame([_op(i, *r) for i, r in enumerate(rows)])


def test_a_cell_takes_the_format_with_the_most_flops_and_shares_of_the_whole_step():
    ops = _ops(
        ("forward", "fc", "bfloat16", 90, 10),
        ("forward", "fc", "float32", 10, 30),  # more bytes, fewer FLOPs: the cell is bf16
        ("forward", "norm", "float32", 0, 40),  # no FLOPs: judged by its bytes
        ("forward", "norm", "bfloat16", 0, 10),
        ("backward", "fc", "bfloat16", 100, 10),
        ("backward", "fc", "bfloat16", 0, 0, "view"),  # views move no data: left out
        ("loss", "-", "float32", 0, 0),
    )
    m = module_phase_map(ops)
    assert m.modules == ("fc", "norm", "(no module)")  # in the order they ran
    assert m.phases == ("forward", "loss", "backward")  # the trace's order, not the data's
    assert m.formats == ("fp32", "bf16")  # FORMATS order
    assert m.matrix("format") == [
        ["bf16", None, "bf16"],
        ["fp32", None, None],
        [None, "fp32", None],
    ]
    assert m.matrix("format_index")[0] == [1, None, 1]
    assert m.matrix("flops_share")[0] == [pytest.approx(0.5), None, pytest.approx(0.5)]
    assert m.matrix("bytes_share")[1][0] == pytest.approx(0.5)  # 50 of the step's 100 bytes
    assert m.matrix("ops")[0] == [2, None, 1]
    assert m.matrix("mix")[0][0] == "bf16 90%, fp32 10% of its FLOPs"
    assert m.matrix("mix")[1][0] == "fp32 80%, bf16 20% of its bytes"


def test_the_ops_of_an_fp8_layer_count_in_the_recipes_format_and_integers_in_other():
    ops = _ops(
        ("forward", "fc", "float32", 100, 10, "compute", "fp8-recipe"),  # the emulated GEMM
        ("forward", "fc", "int64", 0, 50, "compute", "fp8-recipe"),
        ("forward", "act", "int64", 0, 8),  # an index op outside any recipe
        ("forward", "act", "-", 0, 4),
    )
    m = module_phase_map(ops, format_named("nvfp4"))
    assert m.matrix("format") == [["nvfp4"], [OTHER]]
    assert m.formats == ("nvfp4", OTHER)
    assert m.matrix("dtypes") == [["float32, int64"], ["int64"]]
    assert module_phase_map(ops).matrix("format")[0] == ["fp32"]  # no recipe: its dtype's


def test_a_frame_without_the_trace_columns_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="trace_precision"):
        module_phase_map(_ops(("forward", "fc", "float32")).drop(columns=["flops", "bytes"]))


def test_the_figure_has_one_flat_colour_per_format_and_no_text_in_empty_cells():
    m = module_phase_map(_ops(("forward", "fc", "bfloat16", 10, 10), ("loss", "-", "int64", 0, 4)))
    (hm,) = module_phase_figure(m, "t").data
    assert list(hm.colorbar.ticktext) == ["bf16", OTHER] and list(hm.colorbar.tickvals) == [0, 1]
    assert (hm.zmin, hm.zmax) == (-0.5, 1.5)
    steps = [c for _, c in hm.colorscale]
    assert steps == [format_color("bf16")] * 2 + [format_color(OTHER)] * 2
    assert list(hm.text[0]) == ["bf16<br>100% · 71%", ""] and hm.text[1][0] == ""
    assert list(hm.y) == ["fc", "(no module)"] and list(hm.x) == ["forward", "loss"]
    # a colour per row of the table, every one distinct
    assert len({format_color(f) for f in FORMATS}) == len(FORMATS)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)
    ).requires_grad_()


def test_real_traces_show_the_linear_layers_in_bf16_under_o1_and_in_nvfp4_under_nvfp4(model):
    x = torch.randn(8, 16)
    o1 = module_phase_map(mpnb.lab.trace_precision(model, x, "O1").ops, scaled_format("O1"))
    assert o1.matrix("format")[0][0] == "bf16" and o1.matrix("format")[2][0] == "bf16"
    with pytest.warns(UserWarning):  # the emulated FP4 GEMM says so
        nv = mpnb.lab.trace_precision(model, x, "nvfp4")
    m = module_phase_map(nv.ops, scaled_format("nvfp4"))
    fmt = dict(zip(m.modules, (row[0] for row in m.matrix("format")), strict=True))
    assert fmt["0"] == fmt["2"] == "nvfp4" and fmt["1"] == "fp32"  # the ReLU stays float32
    assert sum(v or 0 for row in m.matrix("flops_share") for v in row) == pytest.approx(1.0)


def test_scaled_formats_and_the_what_if_choices_come_from_the_configurations():
    assert scaled_format("O1") is None and scaled_format("bf16-pure") is None
    assert scaled_format("nvfp4-no-rht").name == "nvfp4" and scaled_format("mxfp4").name == "mxfp4"
    choices = what_if_choices()
    assert {"nvfp4", "mxfp4", "mxfp8", "fp8-tensorwise"} <= set(choices)
    assert "O1" not in choices and all(scaled_format(c).scaled for c in choices)
    assert default_what_if() == "nvfp4"  # the narrowest format's first configuration
    assert get_config(default_what_if()).make_recipe() is not None


def test_the_statistics_map_is_the_heatmap_of_the_stats(model):
    stats = mpnb.lab.quant_stats(model, torch.randn(8, 16), "O0", what_if="mxfp4")
    layers, tensors, values = stats.heatmap("underflow_pct")
    (hm,) = stats_figure(stats, "underflow_pct").data
    assert list(hm.y) == layers == ["0", "2"] and list(hm.x) == tensors
    assert [list(r) for r in hm.z] == values
    title = stats_figure(stats, "underflow_pct").layout.title.text
    assert "underflow" in title and "what-if mxfp4" in title and "nothing trained" in title


def test_pictures_redraw_in_place_and_say_why_when_there_is_nothing(model):
    pics = PrecisionPictures()
    assert not pics.stats_view.rendered and "press Trace" in str(pics.stats_view.outputs)
    fig = pics.stats_view.fig
    stats = mpnb.lab.quant_stats(model, torch.randn(8, 16), "O1", what_if="nvfp4")
    pics.show_stats(stats)
    assert pics.stats_view.rendered and pics.stats_view.fig is fig  # the same figure, redrawn
    assert "Worst: layer" in pics.stats_note.value
    pics.metric.value = "mse"
    assert [list(r) for r in fig.data[0].z] == stats.heatmap("mse")[2]
    assert len(fig.data) == 1 and "MSE" in fig.layout.title.text
    pics.show_stats(None, "not computed: no model")
    assert not pics.stats_view.rendered and "no model" in str(pics.stats_view.outputs)
    assert pics.what_if.style.description_width == "initial"  # never "what i..."


def test_every_op_reads_inputs_to_dtype_and_why_in_one_column_each():
    t = ops_table(
        pd.DataFrame(
            [
                _op(0, "forward", "fc", "bfloat16")
                | dict(in_dtypes="bfloat16,bfloat16,float32", detail="cast by autocast"),
                _op(1, "backward", "fc", "float32") | dict(in_dtypes=""),
            ]
        )
    )
    assert list(t.columns) == ["phase", "module", "op", "dtypes", "why"]
    assert list(t["dtypes"]) == ["bfloat16, float32\u00a0\u2192 bfloat16", "\u2192 float32"]
    assert list(t["why"]) == ["cast by autocast", "why"]
