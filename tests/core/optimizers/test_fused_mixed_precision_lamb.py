"""FusedMixedPrecisionLamb (``mpnb/core/optimizers/fused_mixed_precision_lamb.py``): FusedLAMB
with fp32 masters always on (the same bits as ``FusedLAMB(master_weights=True)``), Apex's
initial ``step``, ``reduced_precision_dtype`` checked, and torch's GradScaler handing it the
scale (a skipped step on overflow, the unscaled step otherwise)."""

from __future__ import annotations

import copy

import pytest
import torch

from mpnb.optimizers import FusedLAMB, FusedMixedPrecisionLamb
from tests.core.optimizers.test_base import _mlp, _train_mlp


def test_it_is_fused_lamb_with_masters_bit_for_bit(kernels):
    a, b = _mlp(dtype=torch.bfloat16), _mlp(dtype=torch.bfloat16)
    oa = FusedMixedPrecisionLamb(a.parameters(), lr=1e-2)
    ob = FusedLAMB(b.parameters(), lr=1e-2, weight_decay=0.01, master_weights=True)
    _train_mlp(a, oa, steps=10)
    _train_mlp(b, ob, steps=10)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(oa.state[p]["master_param"], ob.state[q]["master_param"])
        assert torch.equal(p, oa.state[p]["master_param"].bfloat16())


def test_the_initial_step_starts_every_params_count(kernels):
    a, b = _mlp(dtype=torch.bfloat16), _mlp(dtype=torch.bfloat16)
    oa = FusedMixedPrecisionLamb(a.parameters(), lr=1e-2, step=100)
    ob = FusedMixedPrecisionLamb(b.parameters(), lr=1e-2)
    _train_mlp(a, oa, steps=1)
    _train_mlp(b, ob, steps=1)
    assert all(s["step"].item() == 101 for s in oa.state.values())
    assert all(s["step"].item() == 1 for s in ob.state.values())
    # bias correction at step 101 is not step 1's: the updates differ
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_a_param_of_another_dtype_than_reduced_precision_dtype_is_refused():
    m = _mlp(dtype=torch.float16)
    with pytest.raises(ValueError, match="reduced_precision_dtype"):
        FusedMixedPrecisionLamb(m.parameters(), reduced_precision_dtype=torch.bfloat16)
    FusedMixedPrecisionLamb(m.parameters(), reduced_precision_dtype=torch.float16)  # accepted


def test_grad_scaler_hands_it_the_scale(kernels):
    """With a power-of-two scale the scaled step is the plain one bit for bit; an inf grad
    skips the step (nothing written) and backs the scale off."""
    x = torch.randn(8, 13, generator=torch.Generator().manual_seed(3))
    a, b = _mlp(dtype=torch.bfloat16), _mlp(dtype=torch.bfloat16)
    oa, ob = FusedMixedPrecisionLamb(a.parameters()), FusedMixedPrecisionLamb(b.parameters())
    assert oa._step_supports_amp_scaling
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(a(x.bfloat16()).float().pow(2).mean()).backward()
    scaler.step(oa)
    scaler.update()
    b(x.bfloat16()).float().pow(2).mean().backward()
    ob.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    before = copy.deepcopy((a.state_dict(), oa.state_dict()["state"]))
    oa.zero_grad()
    scaler.scale(a(x.bfloat16()).float().pow(2).mean()).backward()
    next(a.parameters()).grad[0, 0] = float("inf")
    scaler.step(oa)
    scaler.update()
    assert scaler.get_scale() == 2.0**9
    assert all(torch.equal(v, before[0][k]) for k, v in a.state_dict().items())
    for pid, s in oa.state_dict()["state"].items():
        assert all(torch.equal(v, before[1][pid][k]) for k, v in s.items())
