"""FusedNovoGrad (``mpnb/core/optimizers/fused_novograd.py``): the per-tensor norms of every
bucket come first and flag overflow (one read of the grads, the scale applied, an inf in the
last bucket skips all), the steps follow the op's reference; a ``norm_type`` other than 0 or
2 is refused.
"""

from __future__ import annotations

import pytest
import torch

from mpnb.optimizers import (
    FusedNovoGrad,
)


def test_novograd_seam_norms_before_any_write(kernels, monkeypatch):
    """The per-tensor norms of every bucket come first and flag overflow: one read of the grads
    (no separate finite pass), the scale applied, and an inf in the last bucket skips all."""
    from mpnb.core.ops import op_info

    reference_fused_novograd_ = op_info("fused_novograd_").reference_kernel  # positional
    from mpnb.core.optimizers import _base

    def no_second_pass(*args):
        raise AssertionError("NovoGrad's norm pass already checks the grads")

    monkeypatch.setattr(_base, "multi_tensor_check_finite", no_second_pass)

    torch.manual_seed(0)
    p16 = [torch.nn.Parameter(torch.randn(n).bfloat16()) for n in (5, 300)]
    p32 = [torch.nn.Parameter(torch.randn(7))]
    opt = FusedNovoGrad(p16 + p32, lr=1e-2, weight_decay=1e-3, master_weights=True)
    ref_w = [p.detach().float().clone() for p in p16 + p32]
    ref_m = [torch.zeros_like(w) for w in ref_w]
    ref_v, ref_s = [torch.tensor(0.0) for _ in ref_w], [torch.tensor(0.0) for _ in ref_w]
    inv = torch.tensor([1 / 256.0])
    for step in range(4):
        for p in p16 + p32:
            p.grad = (torch.randn(p.shape) * 256).to(p.dtype)
        if step == 2:
            p32[0].grad[3] = float("inf")
        grads = [p.grad.float() * inv for p in p16 + p32]
        found = torch.zeros(1)
        opt._mpnb_set_scale(inv, found)
        opt.step()
        assert found.item() == (1.0 if step == 2 else 0.0)
        if step != 2:
            norms = torch.stack([g.double().norm().float() for g in grads])
            reference_fused_novograd_(
                ref_w,
                grads,
                ref_m,
                ref_v,
                [],
                ref_s,
                norms,
                1e-2,
                0.9,
                0.999,
                1e-8,
                1e-3,
                True,
                True,
                False,
                2,
                False,
            )
        ours = [opt.state[p]["master_param"] for p in p16] + [p32[0].detach()]
        for a, b in zip(ours, ref_w, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_norm_type_but_2_is_refused():
    with pytest.raises(ValueError, match="norm_type"):
        FusedNovoGrad([torch.nn.Parameter(torch.zeros(2))], norm_type=1)
