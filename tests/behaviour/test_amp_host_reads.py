"""A steady-state amp step reads nothing on the host with a fused optimizer.

Each host read of a device value (``.item()``, ``.tolist()``, ``bool()``, a blocking copy to the
CPU) makes a GPU step wait; :class:`mpnb.lab.host_reads.HostReads` counts them on any device,
inside the ops' Python kernels too. Steps 3-5 of a small model are counted, for O1/O2/O3 in
fp16 and bf16 with a dynamic loss scale (the one that must decide skips), with every mpnb fused
optimizer and ``torch.optim``'s ``fused=True`` ones, and for the FP8 recipes, on three paths:
the C++ kernels, the references (the ops' pure-PyTorch code), and what CUDA runs without a
Triton kernel (each op's PyTorch-ops path, else its reference: ``use_torch_path``).
``torch.optim``'s Python-loop optimizers keep exactly one read of amp's (the skip), as torch.amp.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mpnb import amp
from mpnb.core.ops import use_reference, use_torch_path
from mpnb.core.precision_configs import get_config
from mpnb.lab.host_reads import HostReads
from mpnb.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

FUSED = {
    "FusedAdam": lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.01),
    "FusedAdam(capturable=True)": lambda p: FusedAdam(p, lr=1e-3, capturable=True),
    "FusedSGD": lambda p: FusedSGD(p, lr=1e-3, momentum=0.9),
    "FusedLAMB": lambda p: FusedLAMB(p, lr=1e-3),
    "FusedNovoGrad": lambda p: FusedNovoGrad(p, lr=1e-3),
    "FusedAdagrad": lambda p: FusedAdagrad(p, lr=1e-3),
    "AdamW(fused=True)": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    "Adam(fused=True)": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
    "SGD(fused=True)": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, fused=True),
}
STEADY = range(3, 6)  # the first steps make lazy state; these three are steady


@pytest.fixture(params=["kernel", "reference", "torch-path"])
def impl(request, kernels):
    """The ops' C++ kernels, their references, or CUDA's path (run on the CPU)."""
    switch = {"reference": use_reference, "torch-path": use_torch_path}.get(request.param)
    if switch is None:
        yield request.param
        return
    with switch():
        yield request.param


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16), torch.nn.LayerNorm(16)
    )


def _reads_per_step(model, opt, dtype=torch.float32, steps=STEADY) -> list[int]:
    """Train ``max(steps) + 1`` steps; the host reads of each of ``steps``."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(max(steps) + 1):
        x = torch.randn(8, 32, generator=g).to(dtype)
        with HostReads() as reads:
            opt.zero_grad()
            loss = model(x).float().pow(2).mean()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        if i in steps:
            out.append(reads.count)
            where = reads.where
    if any(out):
        raise AssertionError(f"host reads per step {out}, the last step's at {where}")
    return out


def _amp_pair(level, half, make, loss_scale="dynamic"):
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return amp.initialize(
            model, make(model.parameters()), opt_level=level, half_dtype=half,
            loss_scale=loss_scale, verbosity=0,
        )  # fmt: skip


@pytest.mark.parametrize("opt_name", list(FUSED))
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_no_host_read_in_a_steady_step(impl, level, half, opt_name):
    model, opt = _amp_pair(level, half, FUSED[opt_name])
    try:
        dtype = torch.float32 if level == "O1" else half
        assert _reads_per_step(model, opt, dtype) == [0] * len(STEADY)
        assert opt._amp_stash.amp_state.host_syncs == 0
    finally:
        amp.current_handle().remove_hooks()


@pytest.mark.parametrize("config", ["fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "mxfp8"])
@pytest.mark.parametrize("opt_name", ["FusedAdam", "AdamW(fused=True)"])
def test_no_host_read_in_a_steady_fp8_step(impl, config, opt_name):
    cfg = get_config(config)
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = cfg.setup(model, FUSED[opt_name](model.parameters()))
    try:
        assert _reads_per_step(model, opt) == [0] * len(STEADY)
    finally:
        amp.current_handle().remove_hooks()


def test_mixed_precision_lamb_reads_nothing(impl):
    model, opt = _amp_pair("O2", torch.bfloat16, lambda p: FusedMixedPrecisionLamb(p, lr=1e-3))
    try:
        assert _reads_per_step(model, opt, torch.bfloat16) == [0] * len(STEADY)
    finally:
        amp.current_handle().remove_hooks()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_python_loop_optimizer_keeps_one_read_of_amps(level):
    """torch.optim.Adam steps in Python (it reads each step count itself); amp adds exactly one
    read per step, the overflow flag it needs to skip, as torch.amp does."""
    model, opt = _amp_pair(level, torch.float16, lambda p: torch.optim.Adam(p, lr=1e-3))
    try:
        with pytest.raises(AssertionError, match="host reads per step"):
            _reads_per_step(model, opt, torch.float32 if level == "O1" else torch.float16)
        plain = _model()
        plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-3)
        plain(torch.randn(8, 32)).sum().backward()
        plain_opt.step()
        with HostReads() as own:
            plain_opt.step()
        amp_state = opt._amp_stash.amp_state
        before = amp_state.host_syncs
        x = torch.randn(8, 32).to(torch.float32 if level == "O1" else torch.float16)
        with HostReads() as reads:
            opt.zero_grad()
            with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
        assert reads.count == own.count + 1
        assert amp_state.host_syncs == before + 1
    finally:
        amp.current_handle().remove_hooks()
