"""Triton ``multi_tensor_l2norm`` against its reference (CPU interpreter, or the GPU when there
is one; see conftest.py)."""

from __future__ import annotations

import pytest
import torch

from mpnb.core.ops import (
    reference_multi_tensor_l2norm,
)

from .triton_cases import SIZES, bitwise, gen, kernel, on, poison, randn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("with_inv", [False, True])
def test_l2norm_matches_reference(device, dtype, per_tensor, with_inv):
    g = gen(4)
    ts = [randn(n, dtype, g, 30.0) for n in SIZES]
    inv = torch.tensor([0.25]) if with_inv else None
    fk, fr = torch.zeros(1, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32)
    got = kernel("multi_tensor_l2norm")(
        fk, on(device, ts), per_tensor, on(device, inv) if with_inv else None
    )
    want = reference_multi_tensor_l2norm(fr, ts, per_tensor, inv)
    # Both accumulate squares in fp64; only the summation order differs.
    rtol = 1e-12 if dtype == torch.float64 else 1e-6
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.cpu(), b, rtol=rtol, atol=0)
    assert fk.item() == fr.item() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_l2norm_nonfinite_flags(device, dtype):
    g = gen(5)
    ts = [randn(n, dtype, g) for n in SIZES]
    poison(ts, g, count=1)
    fk, fr = torch.zeros(1, device=device), torch.zeros(1)
    got = kernel("multi_tensor_l2norm")(fk, on(device, ts), True)
    want = reference_multi_tensor_l2norm(fr, ts, True)
    bitwise(got[0].isfinite(), want[0].isfinite())
    bitwise(got[1].isfinite(), want[1].isfinite())
    assert fk.item() == fr.item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2norm_beyond_fp32_squares(device, dtype):
    """Values whose squares overflow fp32 still give the finite fp32 norm (fp64 squares)."""
    ts = [torch.full((5,), 1e20, dtype=dtype), torch.full((3,), -2e20, dtype=dtype)]
    fk, fr = torch.zeros(1, device=device), torch.zeros(1)
    got = kernel("multi_tensor_l2norm")(fk, on(device, ts), True)
    want = reference_multi_tensor_l2norm(fr, ts, True)
    assert torch.isfinite(got[0]).all() and fk.item() == fr.item() == 0
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-6, atol=0)


def test_l2norm_empty(device):
    flag = torch.zeros(1, device=device)
    total, per = kernel("multi_tensor_l2norm")(flag, [], True)
    assert total.tolist() == [0.0] and per.numel() == 0
    ts = [torch.empty(0, device=device), torch.ones(4, device=device)]
    total, per = kernel("multi_tensor_l2norm")(flag, ts, True)
    assert total.tolist() == [2.0] and per.tolist() == [0.0, 2.0] and flag.item() == 0
