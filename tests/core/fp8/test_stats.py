"""Per-layer quantization statistics (``collect_quant_stats``): counts on hand-built tensors
whose answers are worked out here, errors and scale statistics recomputed from the operand
the recipe produced, accumulation over steps, the what-if mode against a converted model's
first step, and that collecting changes no bit of the step and reads nothing on the host."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from mpnb.core.fp8.fp4_recipes import padded
from mpnb.core.fp8.hadamard import hadamard_transform, te_rht_matrix
from mpnb.core.fp8.stats import METRICS
from mpnb.fp8 import Float8Linear, collect_quant_stats, convert_to_float8_training, recipe

NEAREST = dict(rht=False, stochastic_rounding=False)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emulated-GEMM notes
        yield


def _layer(spec, in_f=32, out_f=16, **kw):
    torch.manual_seed(0)
    return Float8Linear.from_linear(nn.Linear(in_f, out_f, bias=False), recipe(spec, **kw))


def _input_row(layer, *xs, gemm="forward"):
    """The ``input`` row of ``gemm`` after forwards of ``xs`` inside one collector."""
    with collect_quant_stats(layer) as stats:
        for x in xs:
            layer(x)
    df = stats.rows(by_gemm=True)
    return df[(df.tensor == "input") & (df.gemm == gemm)].iloc[0]


def _log2_range(values) -> float:
    nz = [abs(v) for v in values if v != 0]
    return math.log2(max(nz) / min(nz)) if nz else 0.0


# ---- counts on hand-built tensors ------------------------------------------------------------


def test_nvfp4_underflow_of_tiny_values_and_of_a_block_whose_scale_rounds_to_zero():
    # block A: the tensor's amax 2688 = 448 * 6 gives S_enc = 1 and block scale 448, so 0.01
    # encodes to 0.01 / 448 < 0.25 and rounds to 0 (15 underflows). Block B: 1e-4 / 6 is below
    # half of E4M3's smallest subnormal 2**-9, so the block scale is 0 and all 16 decode to 0,
    # without clipping. Row 1: ones (scale e4m3(1/6) = 0.171875, 1 -> 5.8 -> 6), then zeros.
    big = [2688.0] + [0.01] * 15
    x = torch.tensor([big + [1e-4] * 16, [1.0] * 16 + [0.0] * 16])
    row = _input_row(_layer("nvfp4", **NEAREST), x)
    assert row.numel == 64
    assert row.underflow_pct == pytest.approx(100 * 31 / 64)
    assert row.overflow_pct == 0.0
    x32 = x.flatten().tolist()
    assert row.dynamic_range == pytest.approx(_log2_range(x32), rel=1e-6)
    assert row.worst_block_range == pytest.approx(_log2_range(x[0, :16].tolist()), rel=1e-6)


@pytest.mark.parametrize(
    "rounding, under, over",
    [
        # floor: X = 2**(floor(log2 7.5) - 2) = 1, 7.5 saturates at 6 (beyond 7, the midpoint
        # to the next step 8); 0.2 < 0.25 rounds to 0, 0.3 to 0.5
        ("floor", 15, 1),
        # rceil: X = 2**ceil(log2(7.5 / 6)) = 2: nothing clips, 0.1 and 0.15 round to 0
        ("rceil", 31, 0),
    ],
)
def test_mxfp4_underflow_and_saturation_of_a_block_with_one_large_value(rounding, under, over):
    block0 = [7.5] + [0.2] * 15 + [0.3] * 16
    x = torch.tensor([block0 + [4.0] * 32])
    row = _input_row(_layer("mxfp4", in_f=64, scale_rounding=rounding), x)
    assert (row.underflow_pct, row.overflow_pct) == (
        pytest.approx(100 * under / 64),
        pytest.approx(100 * over / 64),
    )
    assert row.worst_block_range == pytest.approx(math.log2(7.5 / 0.2), rel=1e-6)


def test_tensorwise_fp8_underflow_below_half_the_smallest_subnormal():
    # scale 448 / 448 = 1; E4M3's smallest subnormal is 2**-9: 1e-4 (< 2**-10) rounds to 0,
    # 0.0015 rounds up to 2**-9; current scaling never clips
    x = torch.tensor([[448.0] + [1e-4] * 15 + [0.0015] * 16])
    row = _input_row(_layer("tensorwise"), x)
    assert row.underflow_pct == pytest.approx(100 * 15 / 32)
    assert row.overflow_pct == 0.0
    assert (row.scale_inv_min, row.scale_inv_max, row.scale_inv_std) == (1.0, 1.0, 0.0)


def test_delayed_scaling_counts_only_what_saturation_moved():
    # the first step's scale is 1: 500 clips to 448 (beyond 464, the midpoint to the next
    # E4M3 step 480), 450 would round to 448 anyway and does not count
    x = torch.tensor([[500.0, 450.0] + [1e-4] * 30])
    row = _input_row(_layer("delayed"), x)
    assert row.overflow_pct == pytest.approx(100 / 32)
    assert row.underflow_pct == pytest.approx(100 * 30 / 32)


def test_steps_accumulate_as_sums_then_ratios_and_extremes():
    x1 = torch.tensor([[448.0] + [1e-4] * 31])  # 31 underflows of 32, scale inverse 1
    x2 = torch.full((3, 32), 0.5)
    x2[0, 0] = 224.0  # none, scale inverse 0.5
    row = _input_row(_layer("tensorwise"), x1, x2)
    assert row.numel == 128
    assert row.underflow_pct == pytest.approx(100 * 31 / 128)  # not (96.9% + 0%) / 2
    assert (row.scale_inv_min, row.scale_inv_max) == (0.5, 1.0)
    assert row.scale_inv_std == pytest.approx(0.25)
    assert row.dynamic_range == pytest.approx(math.log2(448 / torch.tensor(1e-4).item()))


# ---- errors and scales from the operand itself -----------------------------------------------


def _scales(op):
    if hasattr(op, "block_decode"):
        return op.block_decode()
    return op.dequant_scale.float()


@pytest.mark.parametrize("spec", ["nvfp4", "mxfp4", "mxfp8", "tensorwise", "rowwise"])
def test_mse_rel_err_and_scale_inverses_are_those_of_the_dequantized_operand(spec):
    layer = _layer(spec, in_f=64, out_f=32)
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(3)) * 3
    row = _input_row(layer, x)
    op = layer.recipe.quantize(layer, x, "input", False, gemm="forward")
    d = op.dequantize()[:24, :64].double() - x.double()
    assert row.mse == pytest.approx(d.square().mean().item(), rel=1e-12)
    assert row.rel_err == pytest.approx((d.norm() / x.double().norm()).item(), rel=1e-12)
    s = _scales(op).double()
    assert row.scale_inv_min == s.min().item() and row.scale_inv_max == s.max().item()
    assert row.scale_inv_std == pytest.approx(s.std(correction=0).item(), rel=1e-9, abs=1e-15)


def test_nvfp4_weight_tiles_count_once_and_the_rht_operand_is_measured_after_the_transform():
    layer = _layer("nvfp4", in_f=64, out_f=32, stochastic_rounding=False)
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(4))  # 24 tokens: padded
    with collect_quant_stats(layer) as stats:
        layer(x)
    df = stats.rows(by_gemm=True)
    w = df[(df.tensor == "weight") & (df.gemm == "forward")].iloc[0]
    op = layer.recipe.quantize(layer, layer.weight, "weight", False, gemm="forward")
    tiles = op.block_decode().view(2, 16, 4)[:, 0, :].double()  # a 16x16 tile's scale per row
    assert w.scale_inv_std == pytest.approx(tiles.std(correction=0).item(), rel=1e-9)
    # x^T for dW: tokens padded to 32 with zeros, then TE's RHT along the tokens
    ref = hadamard_transform(padded(x.t(), 1, 16), te_rht_matrix()).double()
    op = layer.recipe.quantize(layer, x.t(), "input", False, gemm="grad_weight")
    g = df[(df.tensor == "input") & (df.gemm == "grad_weight")].iloc[0]
    err = (op.dequantize().double() - ref).square().sum()
    assert g.rel_err == pytest.approx(math.sqrt(err / ref.square().sum()), rel=1e-12)
    assert g.mse == pytest.approx(err.item() / x.numel(), rel=1e-12)


# ---- the step is unchanged, and reads nothing -------------------------------------------------


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 32))


def _steps(model, collect, what_if=None, n=2):
    """Losses and gradients of ``n`` SGD steps (with the collector open when ``collect``)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(5))
    out = []
    for _ in range(n):
        opt.zero_grad()
        if collect:
            with collect_quant_stats(model, what_if=what_if):
                loss = model(x).square().mean()
                loss.backward()
        else:
            loss = model(x).square().mean()
            loss.backward()
        out.append([loss.detach(), *(p.grad.clone() for p in model.parameters())])
        opt.step()
    return out


@pytest.mark.parametrize("spec", ["nvfp4", "mxfp4", "delayed"])
def test_collecting_changes_no_bit_of_a_converted_step(spec):
    base = convert_to_float8_training(_mlp(), recipe(spec) if spec != "mxfp4" else "mxfp4")
    plain, watched = _steps(copy.deepcopy(base), False), _steps(copy.deepcopy(base), True)
    for a, b in zip(plain, watched, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def test_what_if_changes_no_bit_of_the_step():
    plain, watched = _steps(_mlp(), False), _steps(_mlp(), True, what_if="nvfp4")
    for a, b in zip(plain, watched, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def test_a_steady_step_with_the_collector_open_reads_nothing_on_the_host():
    from mpnb.lab.host_reads import HostReads

    layer = _layer("nvfp4")
    x = torch.randn(32, 32)
    with collect_quant_stats(layer) as stats:
        layer(x).sum().backward()
        with HostReads() as reads:
            layer(x).sum().backward()
    assert reads.count == 0, reads.where
    assert stats.rows().numel.tolist() == [2 * 32 * 32 * 2, 2 * 16 * 32 * 2, 2 * 32 * 16 * 2]


# ---- what-if against a converted model ---------------------------------------------------------


@pytest.mark.parametrize("spec", ["nvfp4", "mxfp4", "mxfp8", "tensorwise", "delayed"])
def test_what_if_gives_the_converted_models_first_step_statistics(spec):
    model = _mlp()
    converted = convert_to_float8_training(copy.deepcopy(model), spec)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(6))
    with collect_quant_stats(model, what_if=spec) as guess:
        model(x).square().mean().backward()
    with collect_quant_stats(converted) as real:
        converted(x).square().mean().backward()
    a, b = guess.rows(by_gemm=True), real.rows(by_gemm=True)
    assert guess.what_if and not real.what_if and guess.format == real.format
    key = ["layer", "tensor", "gemm"]
    assert a[key].values.tolist() == b[key].values.tolist()  # the same operands, in order
    # the first layer's input and every weight are the same tensors in both runs
    same = ((a.layer == "0") & (a.tensor == "input")) | (a.tensor == "weight")
    cols = ["numel", *METRICS]
    assert a[same][cols].values.tolist() == b[same][cols].values.tolist()


# ---- the views -------------------------------------------------------------------------------


def test_rows_heatmap_and_worst_follow_the_model():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 48), nn.Linear(48, 16))
    x = torch.randn(16, 32)
    with collect_quant_stats(model, what_if="mxfp4") as stats:
        model(x)  # forward only: no grad_output
    df = stats.rows()
    assert list(df.columns) == ["layer", "tensor", "format", "numel", *METRICS]
    assert df[["layer", "tensor"]].values.tolist() == [
        [n, t] for n in ("0", "2", "3") for t in ("input", "weight")
    ]
    layers, tensors, values = stats.heatmap("underflow_pct")
    assert (layers, tensors) == (["0", "2", "3"], ["input", "weight", "grad_output"])
    assert [len(v) for v in values] == [3, 3, 3] and all(v[2] is None for v in values)
    assert values[1][1] == df.underflow_pct[3]
    top = stats.worst("rel_err")
    assert top["rel_err"] == df.rel_err.max() and top["format"] == "mxfp4 (rceil scales)"


def test_the_observer_is_removed_after_the_block_even_when_it_raises():
    layer = _layer("tensorwise")
    with pytest.raises(KeyError), collect_quant_stats(layer):
        raise KeyError("boom")
    assert "quant_observer" not in vars(layer) and layer.quant_observer is None


def test_errors_name_the_fix():
    converted = convert_to_float8_training(_mlp(), "nvfp4")
    with pytest.raises(ValueError, match="without what_if") as e:
        collect_quant_stats(converted, what_if="mxfp4").__enter__()
    assert "convert_from_float8" in str(e.value)  # or the what-if on the unconverted model
    with pytest.raises(ValueError, match="'nvfp5' is not a recipe"):
        collect_quant_stats(_mlp(), what_if="nvfp5").__enter__()
    with pytest.raises(ValueError, match="convert_to_float8"):
        collect_quant_stats(_mlp()).__enter__()
    with pytest.raises(ValueError, match="no nn.Linear"):
        collect_quant_stats(nn.Conv1d(2, 2, 1), what_if="nvfp4").__enter__()
    with collect_quant_stats(converted) as stats:
        with pytest.raises(RuntimeError, match="close that one first"):
            collect_quant_stats(converted).__enter__()
    with pytest.raises(ValueError, match="forward.*inside"):
        stats.worst()
    with pytest.raises(ValueError, match="unknown metric 'snr'"):
        stats.heatmap("snr")
