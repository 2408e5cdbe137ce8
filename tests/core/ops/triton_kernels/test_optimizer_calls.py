"""mpnb's fused optimizers stepping through the Triton launchers, against the same optimizers
through the dispatcher (the C++ kernels, or the references).

The op tests give each launcher the arguments a test writes; an optimizer writes its own (no
``first_run`` flags without momentum, cached momentum buffers from the second step, bf16
params without masters, the rounding options). On a GPU the measured table can route any of
these calls to Triton by default, so every launcher must take exactly what the optimizers
pass: here the launchers serve the ops for the test (``triton_as_kernels``: interpreted on a
CPU, compiled on a GPU) and three steps are compared with the same optimizer's on the CPU
through the dispatcher.
"""

from __future__ import annotations

import pytest
import torch

from .triton_cases import close, gen, randn, triton_as_kernels

F32, BF16 = torch.float32, torch.bfloat16
SIZES = (7, 1025, 300)

CASES = [
    ("FusedAdam", F32, dict(lr=1e-2, weight_decay=0.01)),
    ("FusedAdam", BF16, dict(lr=1e-2)),  # bf16 params, no masters: the plain op
    ("FusedAdam", BF16, dict(lr=1e-2, stochastic_rounding=True)),
    ("FusedAdam", BF16, dict(lr=1e-2, kahan_summation=True)),
    ("FusedSGD", F32, dict(lr=0.1)),  # no momentum: no buffers, no first_run flags
    ("FusedSGD", F32, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("FusedSGD", BF16, dict(lr=0.1, momentum=0.9)),
    ("FusedSGD", BF16, dict(lr=0.1, stochastic_rounding=True)),
    ("FusedSGD", BF16, dict(lr=0.1, momentum=0.9, kahan_summation=True)),
    ("FusedLAMB", F32, dict(lr=1e-2, weight_decay=0.01)),
    ("FusedLAMB", BF16, dict(lr=1e-2, stochastic_rounding=True)),
]


def _steps(cls_name: str, dtype, options: dict, device: str):
    """The params after three steps of ``cls_name`` on fixed grads."""
    import mpnb.optimizers

    g = gen(0)
    params = [torch.nn.Parameter(randn(n, dtype, g).to(device)) for n in SIZES]
    seeded = torch.Generator().manual_seed(3)  # the same random bits on both paths
    opt = getattr(mpnb.optimizers, cls_name)(params, **options, generator=seeded)
    for step in range(3):
        for i, p in enumerate(params):
            p.grad = randn(p.shape, dtype, gen(10 * step + i)).to(device)
        opt.step()
    return [p.detach().cpu() for p in params]


@pytest.mark.parametrize(("cls_name", "dtype", "options"), CASES, ids=str)
def test_optimizer_steps_through_triton(cls_name, dtype, options, device, ulps):
    want = _steps(cls_name, dtype, options, "cpu")
    with triton_as_kernels(device):
        got = _steps(cls_name, dtype, options, device)
    # a bf16 param is an fp32 value rounded: an fp32 ulp apart can round one bf16 ulp apart
    close(got, want, 4 * ulps if dtype == F32 else 1.0)
