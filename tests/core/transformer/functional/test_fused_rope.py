"""Fused RoPE layers: sbhd / cached / thd / 2-D forms against Apex's textbook formula (forward
and gradient, on the kernel and on the reference), transposed output memory, gradcheck and
errors that name the fix; and the two rounding rules, written from Apex's test_fused_rope:
with ``stepwise=True`` (Apex's kernel) every form equals, bit for bit, the unfused
``t * cos + rotate_half(t) * sin`` computed in ``t``'s dtype, forward and gradient (which Apex's
test compares it with); mpnb's default rounds once from fp32 and lands closer to the exact
result. Under the Apex alias the functions round as Apex's kernel does.

Kernel vs reference on every dtype and both rules, and opcheck: tests/core/ops/test_library.py.
"""

from __future__ import annotations

import pytest
import torch

import mpnb.core.ops as ops
import mpnb.transformer.functional as F
from mpnb.compat import apex_alias
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
    with pytest.raises(ValueError, match=r"d2<=8\]"):
        fused_apply_rotary_pos_emb(t, freqs_for(4, 10))
    with pytest.raises(ValueError, match="even number"):
        fused_apply_rotary_pos_emb(t, torch.zeros(4, 1, 1, 3))
    with pytest.raises(ValueError, match=r"\[s, b, h, d\]"):
        fused_apply_rotary_pos_emb(t[0], freqs_for(4, 8))
    with pytest.raises(TypeError, match="supported dtypes"):
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


# The two rounding rules (stepwise: Apex's kernel; the default: once from fp32)

HALF = (torch.float16, torch.bfloat16)


def unfused(t, cos, sin):
    """Apex's test reference: the expression in t's dtype (the tables cast to it)."""
    d2 = cos.shape[-1]
    c, s = cos.to(t.dtype), sin.to(t.dtype)
    rot = t[..., :d2] * c + rotate_half(t[..., :d2]) * s
    return torch.cat([rot, t[..., d2:]], -1)


def _data(dtype, s=48, b=2, h=3, d=64, d2=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(s, b, h, d, generator=g).to(dtype)
    emb = torch.rand(s, 1, 1, d2, generator=g)  # as Apex's test: random angles in [0, 1)
    dy = torch.rand(s, b, h, d, generator=g).to(dtype)
    return t, emb, dy


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("d2", [64, 32])
def test_stepwise_sbhd_and_cached_are_the_unfused_expression(op_impl, dtype, d2):
    t, emb, dy = _data(dtype, d2=d2)
    want = fwd_bwd(lambda x: unfused(x, emb.cos(), emb.sin()), t, dy)
    for transpose in (False, True):
        got = fwd_bwd(
            lambda x, tr=transpose: F.fused_apply_rotary_pos_emb(x, emb, tr, stepwise=True), t, dy
        )
        _same(got, want)
        cached = fwd_bwd(
            lambda x, tr=transpose: F.fused_apply_rotary_pos_emb_cached(
                x, emb.cos(), emb.sin(), tr, stepwise=True
            ),
            t,
            dy,
        )
        _same(cached, want)
    strided = t.transpose(0, 1).contiguous().transpose(0, 1)  # Apex's transposed inputs
    got = fwd_bwd(lambda x: F.fused_apply_rotary_pos_emb(x, emb, stepwise=True), strided, dy)
    _same(got, want)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_stepwise_thd_and_2d_are_the_unfused_expression(op_impl, dtype):
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 5, 17, 18, 40], dtype=torch.int32)
    t = torch.rand(40, 3, 32, generator=g).to(dtype)
    emb = torch.rand(23, 1, 1, 16, generator=g)
    pos = torch.cat([torch.arange(int(n)) for n in cu.diff()])
    want = fwd_bwd(lambda x: unfused(x[:, None], emb[pos].cos(), emb[pos].sin())[:, 0], t, t)
    _same(
        fwd_bwd(lambda x: F.fused_apply_rotary_pos_emb_thd(x, cu, emb, stepwise=True), t, t), want
    )
    b, ih, iw, h, d = 2, 3, 4, 2, 16
    img = torch.rand(b, ih * iw, h, d, generator=g).to(dtype)
    ang_h, ang_w = (
        torch.rand(1, 5, 1, d // 2, generator=g),
        torch.rand(1, 6, 1, d // 2, generator=g),
    )
    tabs = [x.to(dtype) for x in (ang_h.cos(), ang_h.sin(), ang_w.cos(), ang_w.sin())]

    def unfused_2d(x):
        x = x.view(b, ih, iw, h, d)
        q1, q2 = x.chunk(2, dim=-1)
        ch, sh = tabs[0][:, :ih].unsqueeze(2), tabs[1][:, :ih].unsqueeze(2)
        cw, sw = tabs[2][:, :iw].unsqueeze(1), tabs[3][:, :iw].unsqueeze(1)
        q1 = q1 * ch + rotate_half(q1) * sh
        q2 = q2 * cw + rotate_half(q2) * sw
        return torch.cat([q1, q2], -1).view(b, ih * iw, h, d)

    got = fwd_bwd(
        lambda x: F.fused_apply_rotary_pos_emb_2d(x, ih, iw, *tabs, stepwise=True), img, img
    )
    _same(got, fwd_bwd(unfused_2d, img, img))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_default_rounds_once_and_is_closer_to_the_exact_result(dtype):
    """The two rules differ in many elements (Apex's 13,062 of 32,768 bf16 outputs); mpnb's
    default is the closer to the fp64 result, in total and element by element at worst."""
    t, emb, _ = _data(dtype, s=64, b=2, h=4, d=64, d2=64)
    exact = unfused(t.double(), emb.double().cos(), emb.double().sin())
    once = F.fused_apply_rotary_pos_emb(t, emb).double()
    step = F.fused_apply_rotary_pos_emb(t, emb, stepwise=True).double()
    assert (once != step).float().mean() > 0.05
    err_once, err_step = (once - exact).abs(), (step - exact).abs()
    assert err_once.sum() < err_step.sum()
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
    assert (err_once <= ulp / 2 + 1e-12).float().mean() > (
        err_step <= ulp / 2 + 1e-12
    ).float().mean()


def test_apex_alias_rounds_as_apexs_kernel_and_mpnb_keeps_its_default():
    t, emb, dy = _data(torch.bfloat16)
    with apex_alias():
        from apex.transformer.functional import fused_apply_rotary_pos_emb as apex_rope
        from apex.transformer.functional.fused_rope import fused_apply_rotary_pos_emb_cached

        _same([apex_rope(t, emb)], [unfused(t, emb.cos(), emb.sin())])
        _same([fused_apply_rotary_pos_emb_cached(t, emb.cos(), emb.sin())], [apex_rope(t, emb)])
    assert not torch.equal(F.fused_apply_rotary_pos_emb(t, emb), apex_rope(t, emb))
    # fp32: one rule
    t32 = t.float()
    assert torch.equal(F.fused_apply_rotary_pos_emb(t32, emb), apex_rope(t32, emb))
