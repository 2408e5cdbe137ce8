"""Fused RoPE layers: sbhd / cached / thd / 2-D forms against Apex's textbook formula (forward
and gradient, on the kernel and on the reference), transposed output memory, gradcheck and
errors that name the fix.

Kernel vs reference on every dtype and opcheck: tests/core/ops/test_op_table.py.
"""

from __future__ import annotations

import pytest
import torch

import mpnb.core.ops as ops
from mpnb.transformer.functional import (
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_2d,
    fused_apply_rotary_pos_emb_cached,
    fused_apply_rotary_pos_emb_thd,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def ids(x):
    return str(x).replace("torch.", "")


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def textbook(t, freqs):
    """Apex's unfused formula, in fp64."""
    d2 = freqs.shape[-1]
    x = t.double()
    f = freqs.double()
    rot = x[..., :d2] * f.cos() + rotate_half(x[..., :d2]) * f.sin()
    return torch.cat([rot, x[..., d2:]], -1)


def freqs_for(s, d2, dtype=torch.float32):
    inv = 1.0 / 10000 ** (torch.arange(0, d2, 2, dtype=torch.float64) / d2)
    f = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    return torch.cat([f, f], -1)[:, None, None, :].to(dtype)


def fwd_bwd(fn, t, dy):
    t = t.detach().clone().requires_grad_(True)
    y = fn(t)
    y.backward(dy)
    return y.detach(), t.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("d,d2", [(64, 64), (64, 32), (6, 2), (130, 66)])
@pytest.mark.parametrize("transpose", [False, True])
def test_sbhd_matches_textbook(op_impl, dtype, d, d2, transpose):
    t = torch.randn(7, 3, 2, d, dtype=torch.float64).to(dtype)
    dy = torch.randn(7, 3, 2, d, dtype=torch.float64).to(dtype)
    f = freqs_for(7, d2)
    y, g = fwd_bwd(lambda t: fused_apply_rotary_pos_emb(t, f, transpose), t, dy)
    ty, tg = fwd_bwd(lambda t: textbook(t, f), t.double(), dy.double())
    torch.testing.assert_close(y.double(), ty, **TOL[dtype])
    torch.testing.assert_close(g.double(), tg, **TOL[dtype])
    if transpose:
        assert y.transpose(0, 1).is_contiguous()


def test_cached_and_non_contiguous(op_impl):
    t = torch.randn(3, 9, 4, 32).transpose(0, 1)  # [9, 3, 4, 32] strided (bshd memory)
    f = freqs_for(9, 32)
    y = fused_apply_rotary_pos_emb_cached(t, f.cos(), f.sin())
    torch.testing.assert_close(y.double(), textbook(t, f), rtol=1e-5, atol=1e-5)
    yb = fused_apply_rotary_pos_emb_cached(t.bfloat16(), f.cos().bfloat16(), f.sin().bfloat16())
    torch.testing.assert_close(yb.double(), textbook(t.bfloat16(), f), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=ids)
def test_thd_matches_per_sequence(op_impl, dtype):
    lens = [5, 1, 9]
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    t = torch.randn(15, 2, 16, dtype=torch.float64).to(dtype)
    dy = torch.randn(15, 2, 16, dtype=torch.float64).to(dtype)
    f = freqs_for(12, 16)
    y, g = fwd_bwd(lambda t: fused_apply_rotary_pos_emb_thd(t, cu, f), t, dy)
    start = 0
    for n in lens:
        seq = t[start : start + n, None]  # [n, 1, h, d]
        exp, eg = fwd_bwd(
            lambda s, n=n: textbook(s, f[:n]), seq.double(), dy[start : start + n, None].double()
        )
        torch.testing.assert_close(y[start : start + n].double(), exp[:, 0], **TOL[dtype])
        torch.testing.assert_close(g[start : start + n].double(), eg[:, 0], **TOL[dtype])
        start += n


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=ids)
def test_2d_matches_two_axes(op_impl, dtype):
    b, ih, iw, h, d = 2, 3, 4, 2, 16
    t = torch.randn(b, ih * iw, h, d, dtype=torch.float64).to(dtype)
    fh, fw = freqs_for(5, d // 2), freqs_for(6, d // 2)  # H >= img_h, W >= img_w
    ch, sh = fh.cos().reshape(1, 5, 1, d // 2), fh.sin().reshape(1, 5, 1, d // 2)
    cw, sw = fw.cos().reshape(1, 6, 1, d // 2), fw.sin().reshape(1, 6, 1, d // 2)
    y = fused_apply_rotary_pos_emb_2d(t, ih, iw, ch, sh, cw, sw)
    assert y.shape == t.shape and y.is_contiguous()
    x = t.double().view(b, ih, iw, h, d)
    rows = torch.arange(ih)[:, None].expand(ih, iw)
    cols = torch.arange(iw)[None, :].expand(ih, iw)
    fr = fh[:, 0, 0].double()[rows][None, :, :, None]  # [1, ih, iw, 1, d/2]
    fc = fw[:, 0, 0].double()[cols][None, :, :, None]
    first = x[..., : d // 2] * fr.cos() + rotate_half(x[..., : d // 2]) * fr.sin()
    second = x[..., d // 2 :] * fc.cos() + rotate_half(x[..., d // 2 :]) * fc.sin()
    exp = torch.cat([first, second], -1).view(b, ih * iw, h, d)
    torch.testing.assert_close(y.double(), exp, **TOL[dtype])
    tt = t.double().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda t: fused_apply_rotary_pos_emb_2d(t, ih, iw, ch, sh, cw, sw), (tt,)
    )


def test_gradcheck(op_impl):
    t = torch.randn(4, 2, 3, 10, dtype=torch.float64, requires_grad=True)
    f = freqs_for(4, 8)
    assert torch.autograd.gradcheck(lambda t: fused_apply_rotary_pos_emb(t, f), (t,))
    assert torch.autograd.gradcheck(lambda t: fused_apply_rotary_pos_emb(t, f, True), (t,))


def test_errors_are_clear(op_impl):
    t = torch.randn(4, 2, 3, 8)
    with pytest.raises(ValueError, match=r"\[s=4, 1, 1, d2\]"):
        fused_apply_rotary_pos_emb(t, freqs_for(3, 8))
    with pytest.raises(ValueError, match="d2<=8.*cover every position"):
        fused_apply_rotary_pos_emb(t, freqs_for(4, 10))
    with pytest.raises(ValueError, match="even group.*even number of rotary channels"):
        fused_apply_rotary_pos_emb(t, torch.zeros(4, 1, 1, 3))
    with pytest.raises(ValueError, match=r"\[s, b, h, d\]"):
        fused_apply_rotary_pos_emb(t[0], freqs_for(4, 8))
    with pytest.raises(TypeError, match="supported dtypes.*convert with"):
        fused_apply_rotary_pos_emb(t.int(), freqs_for(4, 8))
    with pytest.raises(ValueError, match="cu_seqlens"):
        fused_apply_rotary_pos_emb_thd(t[0], torch.tensor([0, 1]), freqs_for(4, 8))
    with pytest.raises(ValueError, match="img_h"):
        fused_apply_rotary_pos_emb_2d(t, 3, 3, *[torch.zeros(1, 3, 1, 4)] * 4)
    c = torch.ones(4, 8)
    with pytest.raises(ValueError, match="add the missing dims"):
        ops.rope(t[0], c, c, 8)
    with pytest.raises(ValueError, match="same frequencies"):
        ops.rope(t, c, torch.ones(4, 6), 8)
    with pytest.raises(ValueError, match="float64 table"):
        ops.rope(t.double(), c, c, 8)
