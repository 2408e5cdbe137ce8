"""``mpnb::rope`` (``mpnb/core/ops/rotary.py``) on the C++ kernel: its bf16 stores round as
torch's conversion (to nearest even, subnormals and NaNs included: the reference computes the
same fp32 values and rounds them with ``Tensor.to(torch.bfloat16)``), and a streamed output
(16 MiB or more) holds the bits of ordinary stores, in both layouts: positions are independent,
so the first positions of a large output equal the same positions rotated alone."""

from __future__ import annotations

import pytest
import torch

from mpnb.core.ops.rotary import reference_rope
from tests.core.ops.conftest import same_bits

M = torch.ops.mpnb


@pytest.mark.parametrize("layout", ["sbhd", "bhsd"])
def test_rope_streamed_rows_match(streamed, layout):
    # [s, b, h, d] = (1100, 4, 8, 128) fp32: 18 MB; positions are independent, so the first
    # positions of a large output equal the same positions rotated alone
    g = torch.Generator().manual_seed(4)
    s, b, h, d = 1100, 4, 8, 128
    shape = {"sbhd": (s, b, h, d), "bhsd": (b, h, s, d)}[layout]
    t = torch.randn(shape, generator=g)
    f = torch.rand(s, d, generator=g) * 6
    cos, sin = f.cos(), f.sin()
    k = 37
    at = layout.index("s")
    first = t.narrow(at, 0, k).contiguous()
    small = M.rope(first, cos[:k], sin[:k], d, False, False, False, layout)
    for _ in range(3):  # some call gets a backed (streamed) output
        y = M.rope(t, cos, sin, d, False, False, False, layout)
        assert torch.equal(y.narrow(at, 0, k), small)


def test_rope_bf16_rounds_to_nearest_even_with_subnormals_and_nan(compiled):
    g = torch.Generator().manual_seed(0)
    s, b, h, d = 64, 2, 3, 64
    t = torch.randn(s, b, h, d, generator=g)
    t[: s // 2] *= 1e-30  # products near 1e-39: fp32 (and bf16) subnormals
    t = t.to(torch.bfloat16)
    t[5, 0, 0, 3] = float("nan")  # one block with a NaN, the others without
    t[6, 1, 2, 40] = float("inf")
    f = torch.rand(s, d, generator=g) * 6
    cos, sin = f.cos(), f.sin()
    cos[: s // 2] *= 1e-9
    sin[: s // 2] *= 1e-9
    for backward in (False, True):
        got = M.rope(t, cos, sin, d, False, backward, False, "sbhd")
        want = reference_rope(t, cos, sin, d, backward=backward)
        sub = want.float().abs()
        assert ((sub > 0) & (sub < torch.finfo(torch.float32).tiny)).sum() > 100  # covered
        same_bits(got, want)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


@pytest.mark.parametrize("layout", ["sbhd", "bshd", "bhsd"])
def test_rope_is_the_rotate_half_formula_and_backward_inverts_it(op_impl, layout):
    """fp64, whole head dim rotated: ``t * cos + rotate_half(t) * sin`` per position, and the
    backward (the transposed rotation) gives ``t`` back."""
    g = torch.Generator().manual_seed(5)
    s, b, h, d = 11, 2, 3, 16
    dims = {"s": s, "b": b, "h": h, "d": d}
    t = torch.randn([dims[c] for c in layout], generator=g, dtype=torch.float64)
    half = torch.rand(s, d // 2, generator=g, dtype=torch.float64) * 6
    f = torch.cat([half, half], dim=-1)  # channel i and i + d/2 turn by one angle: a rotation
    cos, sin = f.cos(), f.sin()
    y = M.rope(t, cos, sin, d, False, False, False, layout)
    sbhd = t.permute([layout.index(c) for c in "sbhd"])
    want = sbhd * cos[:, None, None] + _rotate_half(sbhd) * sin[:, None, None]
    torch.testing.assert_close(y.permute([layout.index(c) for c in "sbhd"]), want)
    back = M.rope(y, cos, sin, d, False, True, False, layout)
    torch.testing.assert_close(back, t)


def test_channels_past_the_tables_pass_through(op_impl):
    """Tables narrower than the head dim rotate the first ``d2`` channels only."""
    g = torch.Generator().manual_seed(6)
    t = torch.randn(7, 2, 2, 24, generator=g)
    f = torch.rand(7, 8, generator=g) * 6
    y = M.rope(t, f.cos(), f.sin(), 8, False, False, False, "sbhd")
    assert torch.equal(y[..., 8:], t[..., 8:])
    assert not torch.allclose(y[..., :8], t[..., :8])
