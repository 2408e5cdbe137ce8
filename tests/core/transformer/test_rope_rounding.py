"""Fused RoPE's two rounding rules, written from Apex's test_fused_rope: with ``stepwise=True``
(Apex's kernel) every form equals, bit for bit, the unfused ``t * cos + rotate_half(t) * sin``
computed in ``t``'s dtype, forward and gradient (which Apex's test compares it with); mpnb's
default rounds once from fp32 and lands closer to the exact result. Under the Apex alias the
functions round as Apex's kernel does.

Kernel vs reference for both rules on every dtype, and opcheck: tests/core/ops/test_op_table.py.
"""

from __future__ import annotations

import pytest
import torch

import mpnb.transformer.functional as F
from mpnb.compat import apex_alias

HALF = (torch.float16, torch.bfloat16)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


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


def _fwd_bwd(fn, t, dy):
    t = t.detach().clone().requires_grad_(True)
    y = fn(t)
    y.backward(dy)
    return y.detach(), t.grad


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("d2", [64, 32])
def test_stepwise_sbhd_and_cached_are_the_unfused_expression(op_impl, dtype, d2):
    t, emb, dy = _data(dtype, d2=d2)
    want = _fwd_bwd(lambda x: unfused(x, emb.cos(), emb.sin()), t, dy)
    for transpose in (False, True):
        got = _fwd_bwd(
            lambda x, tr=transpose: F.fused_apply_rotary_pos_emb(x, emb, tr, stepwise=True), t, dy
        )
        _same(got, want)
        cached = _fwd_bwd(
            lambda x, tr=transpose: F.fused_apply_rotary_pos_emb_cached(
                x, emb.cos(), emb.sin(), tr, stepwise=True
            ),
            t,
            dy,
        )
        _same(cached, want)
    strided = t.transpose(0, 1).contiguous().transpose(0, 1)  # Apex's transposed inputs
    got = _fwd_bwd(lambda x: F.fused_apply_rotary_pos_emb(x, emb, stepwise=True), strided, dy)
    _same(got, want)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_stepwise_thd_and_2d_are_the_unfused_expression(op_impl, dtype):
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 5, 17, 18, 40], dtype=torch.int32)
    t = torch.rand(40, 3, 32, generator=g).to(dtype)
    emb = torch.rand(23, 1, 1, 16, generator=g)
    pos = torch.cat([torch.arange(int(n)) for n in cu.diff()])
    want = _fwd_bwd(lambda x: unfused(x[:, None], emb[pos].cos(), emb[pos].sin())[:, 0], t, t)
    _same(
        _fwd_bwd(lambda x: F.fused_apply_rotary_pos_emb_thd(x, cu, emb, stepwise=True), t, t), want
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

    got = _fwd_bwd(
        lambda x: F.fused_apply_rotary_pos_emb_2d(x, ih, iw, *tabs, stepwise=True), img, img
    )
    _same(got, _fwd_bwd(unfused_2d, img, img))


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
