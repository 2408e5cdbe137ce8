"""The fused optimizers with ``torch.amp.GradScaler``: Apex's contract (run_optimizers/test_adam).

GradScaler hands its scale to an optimizer's ``step()`` only when the optimizer says it can take
it (``_step_supports_amp_scaling``); Apex's FusedAdam says so only with ``capturable=True``
(and its kernel then leaves the unscaled grads in ``.grad``), FusedMixedPrecisionLamb always.
Any other fused optimizer gets its grads unscaled by GradScaler itself. Either way, after
``scaler.step`` the weights and the ``.grad``s match ``torch.optim.Adam`` under the same scaler.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mpnb.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)


def test_only_apexs_amp_scaling_optimizers_say_so():
    p = [torch.nn.Parameter(torch.randn(3))]
    assert FusedAdam(p, capturable=True)._step_supports_amp_scaling
    assert FusedMixedPrecisionLamb(p)._step_supports_amp_scaling
    for opt in (FusedAdam(p), FusedSGD(p, lr=0.1), FusedLAMB(p), FusedNovoGrad(p), FusedAdagrad(p)):
        assert not getattr(opt, "_step_supports_amp_scaling", False), type(opt).__name__


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5)
    )


@pytest.mark.parametrize("capturable", [False, True])
def test_grad_scaler_leaves_unscaled_grads_and_adams_weights(capturable):
    ref = _model()
    dut = copy.deepcopy(ref)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    dut_opt = FusedAdam(dut.parameters(), lr=1e-3, adam_w_mode=False, capturable=capturable)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**16) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, target = torch.rand(8, 1, 8, 8, generator=g), torch.rand(8, 5, generator=g)
        for model, opt, scaler in ((ref, ref_opt, scalers[0]), (dut, dut_opt, scalers[1])):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = ((model(x).float() - target) ** 2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        for a, b in zip(ref.parameters(), dut.parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
            # the grads, not 65536 times them: what a clipping or logging hook reads
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6)
        ref_opt.zero_grad()
        dut_opt.zero_grad()
    assert scalers[0].get_scale() == scalers[1].get_scale()
