"""amp's skip decisions, loss-scale trajectories and warnings over an overflow-heavy run.

The gradients of the run are exact powers of two times the loss scale (a bias-free linear layer
on ones, the loss multiplied by a scheduled factor), so whether a half-precision backward
overflows depends only on the scale: the trajectories below hold on every CPU. They were
recorded before the step stopped reading the overflow flag on the host (the skip is now decided
on the device, and the counters behind the collapse error and the static-scale warning live
there too); the step must skip the same steps, move the scale the same way, warn the same
number of times and raise the collapse error at the same step, with every fused optimizer and
with ``torch.optim``'s own, fused or not.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from mpnb import amp
from mpnb.core.amp import LossScaleCollapseError, StaticScaleOverflowWarning
from mpnb.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

NAN = math.nan
#: the loss's factor per step: with the scale s, the fp16 grads are factor * s, which overflow
#: from 2**16 up; nan makes the loss (and every grad) NaN. The first step never overflows, so
#: every optimizer has made its state before the first skip.
SCHEDULE = (2**-8, 1, 1, 2**-2, 2**-2, 1, 2**-8, 2**-8, 2**-8, 2**-8, 1, 2, 4, NAN, 2**-1, 2**-1)
SCHEDULE += (2**-1, 2**-6, 2**-6, 2**-6, 2**-6, 2**-6, 1, 2**-3, 2**-3, NAN, 2**-3, 2**-3)

OPTIMIZERS = {
    "FusedAdam": lambda p: FusedAdam(p, lr=1e-3),
    "FusedSGD": lambda p: FusedSGD(p, lr=1e-3, momentum=0.9),
    "FusedLAMB": lambda p: FusedLAMB(p, lr=1e-3),
    "FusedNovoGrad": lambda p: FusedNovoGrad(p, lr=1e-3),
    "FusedAdagrad": lambda p: FusedAdagrad(p, lr=1e-3),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "AdamW(fused)": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    "SGD(fused)": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, fused=True),
}

#: the scalers' rules of the run (amp.initialize's loss_scale)
RULES = {
    "dynamic": dict(init_scale=2.0**16, growth_interval=2),
    "hysteresis": dict(init_scale=2.0**16, growth_interval=2, hysteresis=2),
    "floor": dict(init_scale=2.0**16, growth_interval=3, min_loss_scale=2.0**13),
    "collapse": dict(
        init_scale=2.0**16, growth_interval=3, min_loss_scale=2.0**13, max_skips_at_min=2
    ),
    "static": 2.0**10,
}


def _snapshot(opt) -> list[torch.Tensor]:
    """Every tensor a step may write: the params it updates and its state (masters, moments,
    step counts)."""
    out = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    for state in opt.state.values():
        out += [v.detach().clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _changed(before: list, after: list) -> bool:
    return len(before) != len(after) or any(
        not torch.equal(a, b) for a, b in zip(before, after, strict=True)
    )


def _run(level, rule, opt_name, schedule=SCHEDULE, half=torch.float16):
    """Train the run; returns per step (scale after the step, stepped?) and the warnings."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -0.25, 0.125, 1.0]]))
    opt = OPTIMIZERS[opt_name](model.parameters())
    model, opt = amp.initialize(
        model, opt, opt_level=level, half_dtype=half, loss_scale=RULES[rule], verbosity=0
    )
    scaler = amp.current_handle().scalers[0]
    x = torch.ones(2, 4, dtype=torch.float32 if level == "O1" else half)
    out, error = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k, factor in enumerate(schedule):
            before = _snapshot(opt)
            opt.zero_grad()
            loss = model(x).float().sum() * factor
            try:
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
            except LossScaleCollapseError:
                error = k
                break
            stepped = _changed(before, _snapshot(opt))
            out.append((scaler.loss_scale(), stepped))
    static = sum(issubclass(c.category, StaticScaleOverflowWarning) for c in caught)
    amp.current_handle().remove_hooks()
    return out, static, error


def _steps(out):
    return "".join("s" if stepped else "-" for _, stepped in out)


# Recorded with the code before the change (a host read per step), the same for every level
# and optimizer: log2 of the scale after each step; which steps wrote ("s") or were skipped
# ("-"); how many StaticScaleOverflowWarnings; the step that raised LossScaleCollapseError.
EXPECTED = {
    "dynamic": (
        [16, 15, 14, 14, 15, 14, 14, 15, 15, 16, 15, 14, 13, 12, 12, 13, 13, 14, 14, 15, 15, 16,
         15, 15, 16, 15, 15, 16],
        "s--ss-ssss----ssssssss-ss-ss", 0, None,
    ),
    "hysteresis": (
        [16, 16, 15, 15, 16, 16, 16, 17, 17, 18, 18, 17, 16, 15, 15, 16, 16, 16, 17, 17, 18, 18,
         18, 17, 17, 17, 17, 18],
        "s--ss-ssss----ss-sssss--s-ss", 0, None,
    ),
    "floor": (
        [16, 15, 14, 14, 14, 15, 15, 15, 16, 16, 15, 14, 13, 13, 13, 13, 14, 14, 14, 15, 15, 15,
         14, 14, 14, 13, 13, 13],
        "s--sssssss----ssssssss-ss-ss", 0, None,
    ),
    "collapse": ([16, 15, 14, 14, 14, 15, 15, 15, 16, 16, 15, 14, 13], "s--sssssss---", 0, 13),
    "static": ([10] * 28, "s" * 28, 2, None),
}  # fmt: skip


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("rule", list(RULES))
def test_trajectory(rule, level, opt_name):
    """The same skips, scales, warnings and collapse step as before, on every path."""
    out, static, error = _run(level, rule, opt_name)
    got = ([int(math.log2(s)) for s, _ in out], _steps(out), static, error)
    assert got == EXPECTED[rule]


@pytest.mark.parametrize("opt_name", ["FusedAdam", "AdamW(fused)", "Adam"])
def test_bf16_dynamic_trajectory(opt_name):
    """bf16 has fp32's range: only the NaN steps skip, and the scale backs off there."""
    out, static, error = _run("O2", "dynamic", opt_name, half=torch.bfloat16)
    skipped = [k for k, (_, stepped) in enumerate(out) if not stepped]
    assert skipped == [k for k, f in enumerate(SCHEDULE) if math.isnan(f)]
    assert (static, error) == (0, None)


def _train(model, opt, x, schedule):
    for factor in schedule:
        opt.zero_grad()
        with amp.scale_loss(model(x).float().sum() * factor, opt) as scaled:
            scaled.backward()
        opt.step()


def _fresh(level, opt_name):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, bias=True)
    opt = OPTIMIZERS[opt_name](model.parameters())
    return amp.initialize(
        model, opt, opt_level=level, half_dtype=torch.float16, loss_scale=RULES["floor"],
        verbosity=0,
    )  # fmt: skip


@pytest.mark.parametrize(
    "level, opt_name", [("O2", "FusedAdam"), ("O1", "AdamW(fused)"), ("O2", "AdamW(fused)")]
)
def test_resume_through_the_overflows_is_bitwise(level, opt_name):
    """Save in the middle of the overflow-heavy run, resume in fresh objects: the same weights,
    optimizer state and amp state, bit for bit, as the run that never stopped."""
    x = torch.ones(2, 4, dtype=torch.float32 if level == "O1" else torch.float16)
    k = 14  # mid-run: the scale is at the floor and the last steps were skipped
    model, opt = _fresh(level, opt_name)
    _train(model, opt, x, SCHEDULE)
    full = ([t.clone() for t in model.state_dict().values()], amp.state_dict())
    full_opt = opt.state_dict()["state"]
    amp.current_handle().remove_hooks()

    model, opt = _fresh(level, opt_name)
    _train(model, opt, x, SCHEDULE[:k])
    ckpt = dict(model=model.state_dict(), opt=opt.state_dict(), amp=amp.state_dict())
    ckpt = {key: _deep_clone(v) for key, v in ckpt.items()}
    amp.current_handle().remove_hooks()

    model, opt = _fresh(level, opt_name)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    amp.load_state_dict(ckpt["amp"])
    _train(model, opt, x, SCHEDULE[k:])
    assert amp.state_dict() == full[1]
    for a, b in zip(model.state_dict().values(), full[0], strict=True):
        assert torch.equal(a, b)
    for pid, state in opt.state_dict()["state"].items():
        for key, v in state.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(full_opt[pid][key])), key
    amp.current_handle().remove_hooks()


def _deep_clone(v):
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: _deep_clone(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_deep_clone(x) for x in v]
    return v
