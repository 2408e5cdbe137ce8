"""The ``cuda`` suite's "O2 step" case times what mpnb's amp O2 step really runs: the ``mpnb::``
ops of ``optimizer.step()`` under amp O2 with ``FusedAdam`` are held to the case's list
(:data:`~mpnb.lab.bench._cuda_lists.O2_STEP_OPS`), on the CPU (the same ops dispatch to the
Triton kernels on CUDA). Should the step change (the check fused into the update, say), this
fails and the bench case is changed with it. A dynamic loss scale (fp16's) also updates itself
after the step (``update_loss_scale_``, one-element tensors), as torch.amp's
``GradScaler.update`` does (``_amp_update_scale_``): neither side of the case times it."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mpnb import amp, optimizers
from mpnb.lab.bench._cuda_lists import O2_STEP_OPS


class _MpnbOps(TorchDispatchMode):
    """Records the ``mpnb::`` ops dispatched inside it, by name, in order."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("mpnb::"):
            self.names.append(name.removeprefix("mpnb::"))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_amp_o2_step_with_fused_adam_runs_the_cases_ops(half):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = optimizers.FusedAdam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=half, verbosity=0)
    for _ in range(2):  # the first step and a steady one
        loss = model(torch.randn(4, 8).to(half)).float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        with _MpnbOps() as seen:
            opt.step()
        opt.zero_grad()
        scale_update = ("update_loss_scale_",) if half == torch.float16 else ()
        assert tuple(seen.names) == O2_STEP_OPS + scale_update
