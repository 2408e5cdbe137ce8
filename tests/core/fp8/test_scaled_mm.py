"""What torch._scaled_mm does on the CPU (the claims in mpnb.core.fp8.gemm, measured each run),
and the rule deciding where mpnb calls it."""

import itertools

import pytest
import torch

from mpnb import fp8

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
