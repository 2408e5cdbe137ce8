"""The four-bit recipes in a ``Float8Linear``: each GEMM is ``fp4_mm`` of its operands quantized
as the recipe says (16x16 weight blocks, the RHT on the Wgrad operands only, stochastic rounding
of the gradients only), shapes off the blocks are padded with zeros, and each switch changes
exactly its ingredient; the lab's configurations train with them."""

from __future__ import annotations

import warnings

import pytest
import torch

from mpnb.core.fp8.fp4_gemm import fp4_mm
from mpnb.core.fp8.fp4_recipes import padded
from mpnb.core.fp8.hadamard import te_rht_matrix
from mpnb.core.fp8.mxfp4 import quantize_mxfp4
from mpnb.core.fp8.nvfp4 import quantize_nvfp4
from mpnb.fp8 import Float8Linear, recipe

NEAREST = dict(stochastic_rounding=False)


def _layer(spec, in_f=48, out_f=32, **kw):
    torch.manual_seed(0)
    return Float8Linear.from_linear(torch.nn.Linear(in_f, out_f, bias=False), recipe(spec, **kw))


def _run(layer, x, gy):
    x = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = layer(x)
        y.backward(gy)
    return y.detach(), x.grad, layer.weight.grad


def _data(rows=32, in_f=48, out_f=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, in_f, generator=g), torch.randn(rows, out_f, generator=g)


def test_nvfp4_gemms_are_fp4_mm_of_the_operands_te_quantizes():
    layer = _layer("nvfp4", **NEAREST)
    x, gy = _data()
    w = layer.weight.detach()
    y, gx, gw = _run(layer, x, gy)
    h = te_rht_matrix()
    assert torch.equal(y, fp4_mm(quantize_nvfp4(x), quantize_nvfp4(w, tile_rows=16), x.dtype))
    want_gx = fp4_mm(quantize_nvfp4(gy), quantize_nvfp4(w.t(), tile_rows=16), x.dtype)
    assert torch.equal(gx, want_gx)
    want_gw = fp4_mm(quantize_nvfp4(gy.t(), hadamard=h), quantize_nvfp4(x.t(), hadamard=h), w.dtype)
    assert torch.equal(gw, want_gw)


@pytest.mark.parametrize(
    "variant, changed",
    [
        (dict(rht=False), {"grad_weight"}),
        (dict(two_d=False), {"forward", "grad_input"}),
    ],
)
def test_each_switch_changes_exactly_its_ingredient(variant, changed):
    x, gy = _data()
    base = _run(_layer("nvfp4", **NEAREST), x, gy)
    other = _run(_layer("nvfp4", **NEAREST, **variant), x, gy)
    differs = {
        n
        for n, a, b in zip(("forward", "grad_input", "grad_weight"), base, other, strict=True)
        if not torch.equal(a, b)
    }
    assert differs == changed


def test_two_d_blocks_quantize_w_and_w_transposed_alike():
    w = _layer("nvfp4").weight.detach()
    for tile, alike in ((16, True), (1, False)):
        fwd = quantize_nvfp4(w, tile_rows=tile).dequantize()
        bwd = quantize_nvfp4(w.t(), tile_rows=tile).dequantize()
        assert torch.equal(fwd, bwd.t()) == alike


def test_stochastic_rounding_touches_the_gradients_only_and_reproduces():
    x, gy = _data()
    a = _run(_layer("nvfp4"), x, gy)
    b = _run(_layer("nvfp4"), x, gy)  # same seed, fresh layer: the same bits
    near = _run(_layer("nvfp4", **NEAREST), x, gy)
    other_seed = _run(_layer("nvfp4", seed=5), x, gy)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert torch.equal(a[0], near[0])  # the forward has no gradient in it
    assert not torch.equal(a[1], near[1]) and not torch.equal(a[2], near[2])
    assert not torch.equal(a[1], other_seed[1])


def test_shapes_off_the_blocks_are_padded_with_zeros():
    layer = _layer("nvfp4", in_f=40, out_f=10, **NEAREST)
    x, gy = _data(rows=24, in_f=40, out_f=10)
    y, gx, gw = _run(layer, x, gy)
    w = layer.weight.detach()
    want = fp4_mm(
        quantize_nvfp4(padded(x, 1, 16)), quantize_nvfp4(padded(w, 16, 16), tile_rows=16), x.dtype
    )[:24, :10]
    assert torch.equal(y, want)
    assert gx.shape == x.shape and gw.shape == w.shape


def test_mxfp4_forward_is_fp4_mm_of_mx_operands_and_sr_rht_change_the_backward_only():
    x, gy = _data(in_f=64)
    plain = _layer("mxfp4", in_f=64)
    y, gx, gw = _run(plain, x, gy)
    w = plain.weight.detach()
    assert torch.equal(y, fp4_mm(quantize_mxfp4(x), quantize_mxfp4(w), x.dtype))
    tuned = _run(_layer("mxfp4", in_f=64, rht=True, stochastic_rounding=True), x, gy)
    assert torch.equal(tuned[0], y) and not torch.equal(tuned[2], gw)


def test_labels_say_what_each_recipe_computes():
    assert recipe("nvfp4").label == "nvfp4 (TE v2.14, 2d, rht, sr)"
    assert recipe("nvfp4", torchao=True, rht=False, stochastic_rounding=False).label == (
        "nvfp4 (torchao)"
    )
    assert recipe("mxfp4", rht=True, stochastic_rounding=True).label == (
        "mxfp4 (rceil scales, rht, sr)"
    )
    with pytest.raises(ValueError, match="formula"):
        recipe("nvfp4", formula="v3")
    with pytest.raises(ValueError, match="rounds to nearest"):
        _run(_layer("nvfp4", torchao=True), *_data())


@pytest.mark.parametrize(
    "name, fmt",
    [
        ("nvfp4", "nvfp4"),
        ("nvfp4-no-rht", "nvfp4"),
        ("nvfp4-no-sr", "nvfp4"),
        ("nvfp4-1d", "nvfp4"),
        ("nvfp4-torchao", "nvfp4"),
        ("mxfp4", "mxfp4"),
        ("mxfp4+sr+rht", "mxfp4"),
    ],
)
def test_the_lab_trains_each_four_bit_configuration(name, fmt):
    import mpnb.lab

    df = mpnb.lab.compare("mlp", configs=("O0", name), steps=3, progress=False, threads=1)
    row = df.iloc[1]
    assert row.status == "ok", row.error
    assert row.precision == f"{fmt} (emulated)"


@pytest.mark.parametrize("spec", ["nvfp4", "mxfp4"])
def test_a_steady_four_bit_step_reads_nothing_on_the_host(spec):
    from mpnb.lab.host_reads import HostReads

    layer = _layer(spec, rht=True, stochastic_rounding=True)
    x, gy = _data()
    _run(layer, x, gy)  # the first step builds what later steps reuse
    with HostReads() as reads:
        _run(layer, x, gy)
    assert reads.count == 0, reads.where
