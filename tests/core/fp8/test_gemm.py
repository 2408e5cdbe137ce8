"""The FP8 GEMM ``a @ b.T``: what torch._scaled_mm does on the CPU (the claims in
mpnb.core.fp8.gemm, measured each run), the rule deciding where mpnb calls it, the emulated
GEMM every fallback computes, and where ``fp8_mm`` sends each kind of operand.

The native block-scaled path (sm100) and its first-use check: tests/core/fp8/test_blocked.py."""

import itertools

import pytest
import torch

from mpnb import fp8
from mpnb.core.fp8 import gemm

F8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
ONE = torch.tensor(1.0)


def _exact(a, b, sa=1.0, sb=1.0):
    return (a.double() * sa) @ (b.double() * sb)


@pytest.mark.parametrize("da, db", list(itertools.product(F8, F8[:2])))
def test_cpu_scaled_mm_takes_every_float8_pair(da, db):
    a, b = torch.randn(8, 32).to(da), torch.randn(32, 16).to(db)
    out = torch._scaled_mm(a, b, ONE, ONE, out_dtype=torch.float32)
    assert torch.allclose(out.double(), _exact(a, b), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("m, k, n", [(30, 40, 24), (1, 8, 5), (3, 7, 2)])
def test_cpu_scaled_mm_has_no_multiple_of_16_rule_and_either_layout(m, k, n):
    a = torch.randn(m, k).to(torch.float8_e4m3fn)
    b = torch.randn(n, k).to(torch.float8_e4m3fn)
    col = torch._scaled_mm(a, b.t(), ONE, ONE, out_dtype=torch.float32)  # CUDA's layout
    row = torch._scaled_mm(a, b.t().contiguous(), ONE, ONE, out_dtype=torch.float32)
    assert torch.equal(col, row)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_scaled_mm_scale_shapes(out_dtype):
    a = torch.randn(8, 64).to(torch.float8_e4m3fn)
    b = torch.randn(16, 64).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(8, 1) + 0.5, torch.rand(1, 16) + 0.5
    out = torch._scaled_mm(a, b.t(), sa, sb, out_dtype=out_dtype)  # rowwise: (M,1) and (1,N)
    # one float32 matmul of the scaled operands, one cast at the end
    ref = ((a.float() * sa) @ (b.float().t() * sb)).to(out_dtype)
    assert torch.equal(out, ref)
    with pytest.raises((ValueError, RuntimeError), match="Invalid scaling"):
        torch._scaled_mm(a, b.t(), sa.view(-1), sb.view(-1), out_dtype=out_dtype)  # 1-D


def test_cpu_scaled_mm_rejects_mx_and_blockwise_scales():
    """The reason MXFP8 runs emulated on the CPU (measured, not assumed)."""
    a = torch.randn(128, 256).to(torch.float8_e4m3fn)
    b = torch.randn(128, 256).to(torch.float8_e4m3fn)
    e8 = torch.ones(128, 8).to(torch.float8_e8m0fnu)
    with pytest.raises((ValueError, RuntimeError), match="Invalid scaling"):
        torch._scaled_mm(a, b.t(), e8, e8, out_dtype=torch.bfloat16)
    with pytest.raises((ValueError, RuntimeError), match="Invalid scaling"):  # 1x128 x 128x128
        torch._scaled_mm(a, b.t(), torch.ones(128, 2), torch.ones(1, 2), out_dtype=torch.bfloat16)


def test_where_mpnb_calls_scaled_mm():
    rule = fp8.scaled_mm_rule
    assert rule("cpu", None, "tensorwise", 40, 24, torch.float32) is None
    assert rule("cpu", None, "rowwise", 7, 3, torch.float32) is None
    assert rule("cpu", None, "mx", 64, 64, torch.bfloat16)[0] == "recipe"
    assert rule("cuda", (9, 0), "mx", 64, 64, torch.bfloat16)[0] == "recipe"
    assert rule("cuda", (8, 0), "tensorwise", 64, 64, torch.float32)[0] == "device"
    assert rule("cuda", (8, 9), "tensorwise", 64, 64, torch.float32) is None
    assert rule("cuda", (8, 9), "rowwise", 64, 64, torch.bfloat16)[0] == "device"
    assert rule("cuda", (9, 0), "rowwise", 64, 64, torch.float32)[0] == "out_dtype"
    assert rule("cuda", (9, 0), "rowwise", 64, 64, torch.bfloat16) is None
    shape = rule("cuda", (9, 0), "tensorwise", 40, 64, torch.float32)
    assert shape[0] == "shape" and "K=40, N=64" in shape[1]
    assert rule("cuda", (9, 0), "tensorwise", 64, 24, torch.float32)[0] == "shape"
    assert rule("mps", None, "tensorwise", 64, 64, torch.float32)[0] == "device"
    # Both CUDA causes at once (a float32 rowwise layer of odd width): named together, so
    # that fixing one does not reveal the other on the next run.
    both = rule("cuda", (9, 0), "rowwise", 40, 24, torch.float32)
    assert both[0] == "out_dtype+shape"
    assert "only writes bfloat16" in both[1] and "K=40, N=24" in both[1]


def _operands(granularity, m=6, k=64, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    quant = {
        "tensorwise": lambda t: fp8.quantize_tensorwise(t, torch.float8_e4m3fn),
        "rowwise": lambda t: fp8.quantize_rowwise(t, torch.float8_e4m3fn),
        "mx": lambda t: fp8.quantize_mx(t, torch.float8_e4m3fn),
    }[granularity]
    return quant(x), quant(w)


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "mx"])
def test_emulated_mm_is_the_exact_product_up_to_float32_accumulation(granularity):
    a, b = _operands(granularity)
    da, db = a.dequantize().double(), b.dequantize().double()
    y = fp8.emulated_mm(a, b, torch.float32)
    assert y.shape == (6, 5) and y.dtype == torch.float32
    bound = (64 + 1) * 2.0**-24 * (da.abs() @ db.abs().t())
    assert ((y.double() - da @ db.t()).abs() <= bound).all()
    for dtype in (torch.bfloat16, torch.float16):  # one cast from the float32 result
        assert torch.equal(fp8.emulated_mm(a, b, dtype), y.to(dtype))


def test_fp8_mm_sends_each_operand_kind_to_its_gemm(monkeypatch):
    calls = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(args[2].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    for granularity in ("tensorwise", "rowwise"):
        a, b = _operands(granularity)
        emulated = fp8.fp8_mm(a, b, torch.float32, scaled_mm=False)
        assert calls == [] and torch.equal(emulated, fp8.emulated_mm(a, b, torch.float32))
        native = fp8.fp8_mm(a, b, torch.float32, scaled_mm=True)
        assert len(calls) == 1
        # the same bits where oneDNN scales before it accumulates (AVX2); its AMX path scales
        # a tensorwise product after: float32 rounding apart (measured: 2.4 * 2^-24 at most)
        size = a.dequantize().abs() @ b.dequantize().abs().t()
        assert ((native - emulated).abs() <= 4 * 2.0**-24 * size).all()
        if torch.backends.cpu.get_cpu_capability() == "AVX2" or granularity == "rowwise":
            assert torch.equal(native, emulated)
        calls.clear()
    a, b = _operands("mx")
    assert torch.equal(fp8.fp8_mm(a, b, torch.float32, False), fp8.emulated_mm(a, b, torch.float32))
    x, w = torch.randn(4, 64), torch.randn(3, 64)
    qa, qb = fp8.quantize_nvfp4(x), fp8.quantize_nvfp4(w)
    assert torch.equal(fp8.fp8_mm(qa, qb, torch.float32, False), fp8.fp4_mm(qa, qb, torch.float32))
    assert calls == []


def test_on_the_cpu_block_scaled_gemms_are_blocked_with_their_reason():
    a, b = _operands("mx")
    category, reason = fp8.scaled_mm_blocker(a, b, torch.float32)
    assert category == "recipe" and "sm100" in reason
    x = torch.randn(4, 64)
    nv, mx = fp8.quantize_nvfp4(x), fp8.quantize_mxfp4(x)
    for op, key in ((nv, ("nvfp4",)), (mx, ("mxfp4",))):
        category, reason = fp8.scaled_mm_blocker(op, op, torch.float32)
        assert category == "fp4" and reason.startswith(op.label)
        assert gemm.block_format(op, op, torch.float32) == key
    assert gemm.block_format(a, b, torch.bfloat16) == (
        "mxfp8",
        a.data.dtype,
        b.data.dtype,
        torch.bfloat16,
    )
    assert gemm.device_capability("cpu") is None
    for fmt in ("nvfp4", "mxfp4", "mxfp8"):
        assert gemm.block_scaled_status("cpu", fmt) == "emulated"
