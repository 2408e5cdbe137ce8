"""mpnb.compat.apex_rules: mpnb's objects configured with Apex's numerics."""

from __future__ import annotations

import torch

from mpnb.compat import apex_rules
from mpnb.core.optimizers.fused_sgd import FusedSGD
from mpnb.core.transformer.functional import fused_rope


def test_fused_sgd_defaults_to_stepwise_rounding_and_keeps_the_argument():
    params = [torch.nn.Parameter(torch.randn(4).half())]
    assert apex_rules.FusedSGD(params, lr=0.1, momentum=0.9).stepwise_rounding is True
    assert apex_rules.FusedSGD(params, lr=0.1, stepwise_rounding=False).stepwise_rounding is False
    assert FusedSGD(params, lr=0.1, momentum=0.9).stepwise_rounding is False  # mpnb's default
    assert issubclass(apex_rules.FusedSGD, FusedSGD)


def test_fused_sgd_steps_as_torch_sgd_on_half_params():
    torch.manual_seed(0)
    w = torch.randn(64).half()
    grads = [torch.randn(64).half() for _ in range(5)]
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    ours = apex_rules.FusedSGD([a], lr=0.1, momentum=0.9)
    theirs = torch.optim.SGD([b], lr=0.1, momentum=0.9)
    for g in grads:
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def _rotate_half(t):
    x1, x2 = t.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def test_rope_rounds_each_product_in_the_inputs_dtype_as_apex():
    torch.manual_seed(1)
    t = torch.randn(8, 2, 3, 16).half()  # [s, b, h, d]
    freqs = torch.randn(8, 1, 1, 16)
    cos, sin = freqs.cos().half(), freqs.sin().half()
    apex = t * cos + _rotate_half(t) * sin  # Apex's unfused reference, in fp16
    got = apex_rules.fused_apply_rotary_pos_emb(t, freqs)
    assert torch.equal(got, apex)
    got_cached = apex_rules.fused_apply_rotary_pos_emb_cached(t, cos, sin)
    assert torch.equal(got_cached, apex)
    mpnb_default = fused_rope.fused_apply_rotary_pos_emb(t, freqs)
    torch.testing.assert_close(mpnb_default, apex, rtol=2e-3, atol=2e-3)


def test_every_name_is_served_in_place_of_the_homes():
    for name in apex_rules.__all__:
        ours = getattr(apex_rules, name)
        assert ours.__doc__ and ("Apex" in ours.__doc__ or "stepwise" in ours.__doc__), name
