"""mpnb's fused optimizers stepping through the Triton launchers, against the same optimizers
through the dispatcher (the C++ kernels, or the references).

The op tests give each launcher the arguments a test writes; an optimizer writes its own (no
``first_run`` flags without momentum, cached momentum buffers from the second step, bf16
params without masters, the rounding options). On a GPU the measured table can route any of
these calls to Triton by default, so every launcher must take exactly what the optimizers
pass: here each optimizer module's op is swapped for its launcher (interpreted on a CPU,
compiled on a GPU) and three steps are compared with the same optimizer's on the CPU through
the dispatcher.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from mpnb.core.ops import op_info

from .triton_cases import close, gen, kernel, randn

F32, BF16 = torch.float32, torch.bfloat16
SIZES = (7, 1025, 300)
MODULES = ("fused_adam", "fused_sgd", "fused_lamb")

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


def _through_triton(name: str):
    """Op ``name`` called as an optimizer calls it, served by its Triton launcher."""
    sig = inspect.signature(op_info(name).reference)
    params = list(sig.parameters)

    def call(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return kernel(name)(*[bound.arguments[p] for p in params])

    return call


def _steps(cls_name: str, dtype, options: dict, device: str, triton: bool, monkeypatch):
    """The params after three steps of ``cls_name`` on fixed grads."""
    import mpnb.optimizers
    from mpnb.core.ops.triton import LAUNCHERS

    with monkeypatch.context() as m:
        if triton:
            for mod in MODULES:
                module = importlib.import_module(f"mpnb.core.optimizers.{mod}")
                for name in [n for n in vars(module) if n in LAUNCHERS]:
                    m.setattr(module, name, _through_triton(name))
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
def test_optimizer_steps_through_triton(cls_name, dtype, options, device, ulps, monkeypatch):
    want = _steps(cls_name, dtype, options, "cpu", False, monkeypatch)
    got = _steps(cls_name, dtype, options, device, True, monkeypatch)
    # a bf16 param is an fp32 value rounded: an fp32 ulp apart can round one bf16 ulp apart
    close(got, want, 4 * ulps if dtype == F32 else 1.0)
