"""``profile``: where one training step's time goes, per opt level.

For each opt level a deep copy of your model (yours is never changed) trains a few steps and
reports:

* ``phases``: median time of forward (model + loss), backward, unscale and update (leaving
  ``amp.scale_loss``: unscale, master-grad copies, overflow check, the loss-scale update),
  and the optimizer step (a fused optimizer unscales inside it, and amp updates the scale
  right after it);
* ``modules``: per leaf module, forward time, output size and output dtype (one forward with
  hooks, so you see which layers really run in half);
* ``flops``: FLOPs of one forward + backward from ``torch.utils.flop_counter.FlopCounterMode``
  and the achieved FLOP/s over the measured forward + backward time;
* ``ops``: the ``torch.profiler`` op table of one step (self time, calls).

Times come from ``torch.utils.benchmark.timer`` (synchronizing CUDA), medians over ``steps``
steps after ``warmup`` untimed ones.
"""

from __future__ import annotations

import copy
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch.utils import benchmark
from torch.utils.flop_counter import FlopCounterMode

from mpnb.core.amp import HALF_DTYPES
from mpnb.lab._errors import describe_error
from mpnb.lab._train import forward, make_optimizer, to_device
from mpnb.lab.config import half_name, resolve_device
from mpnb.lab.stats import median

__all__ = ["ProfileResult", "profile", "PHASES"]

PHASES = ("forward", "backward", "unscale_and_update", "optimizer_step")


@dataclass
class ProfileResult:
    """The tables :func:`profile` returns (long format, one ``opt_level`` column each)."""

    phases: pd.DataFrame
    modules: pd.DataFrame
    flops: pd.DataFrame
    ops: pd.DataFrame
    errors: dict = field(default_factory=dict)


def _default_loss(out) -> torch.Tensor:
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.float().pow(2).mean()


class _Level:
    """One opt level's copy of the model, its optimizer, scaler and a timed step."""

    def __init__(self, model, level, half, opt_name, lr, device):
        from mpnb import amp

        self.model = copy.deepcopy(model).to(device)
        opt = make_optimizer(opt_name, self.model.parameters(), lr)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model, self.opt = amp.initialize(
                self.model, opt, opt_level=level, half_dtype=half, verbosity=0
            )

    def step(self, x, loss_fn) -> dict[str, float]:
        from mpnb import amp

        clock = benchmark.timer
        self.opt.zero_grad(set_to_none=True)
        t0 = clock()
        loss = loss_fn(forward(self.model, x))
        t1 = clock()
        cm = amp.scale_loss(loss, self.opt)
        scaled = cm.__enter__()
        scaled.backward()
        t2 = clock()
        cm.__exit__(None, None, None)  # unscale, overflow check and the scale update
        t3 = clock()
        self.opt.step()  # a fused optimizer unscales inside its step, then amp updates the scale
        t4 = clock()
        return {
            "forward": t1 - t0,
            "backward": t2 - t1,
            "unscale_and_update": t3 - t2,
            "optimizer_step": t4 - t3,
        }


def _module_table(model, x) -> list[dict]:
    rows, starts, hooks = [], {}, []

    def pre(name):
        def hook(mod, args):
            starts[name] = benchmark.timer()

        return hook

    def post(name):
        def hook(mod, args, out):
            dt = benchmark.timer() - starts.pop(name, benchmark.timer())
            o = out[0] if isinstance(out, (tuple, list)) else out
            is_t = isinstance(o, torch.Tensor)
            rows.append(
                dict(
                    module=name,
                    type=type(mod).__name__,
                    time_ms=dt * 1e3,
                    output_mib=o.numel() * o.element_size() / 2**20 if is_t else 0.0,
                    output_dtype=str(o.dtype).replace("torch.", "") if is_t else "-",
                )
            )

        return hook

    for name, mod in model.named_modules():
        if name and not any(True for _ in mod.children()):
            hooks += [
                mod.register_forward_pre_hook(pre(name)),
                mod.register_forward_hook(post(name)),
            ]
    try:
        with torch.no_grad():
            forward(model, x)
    finally:
        for h in hooks:
            h.remove()
    return rows


def _flops(lv: _Level, x, loss_fn) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        lv.opt.zero_grad(set_to_none=True)
        loss_fn(forward(lv.model, x)).float().backward()
    lv.opt.zero_grad(set_to_none=True)
    lv.model.zero_grad(set_to_none=True)  # O2: the half grads must not reach the next step
    return counter.get_total_flops()


def _op_table(lv: _Level, x, loss_fn, top: int) -> list[dict]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=acts) as prof:
        lv.step(x, loss_fn)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        dict(
            op=e.key,
            calls=e.count,
            self_cpu_ms=e.self_cpu_time_total / 1e3,
            cpu_total_ms=e.cpu_time_total / 1e3,
        )
        for e in events[:top]
    ]


def _profile_level(model, x, loss_fn, level, half, opt_name, lr, device, steps, warmup, top):
    lv = _Level(model, level, half, opt_name, lr, device)
    times = defaultdict(list)
    for i in range(warmup + steps):
        t = lv.step(x, loss_fn)
        if i >= warmup:
            for k, v in t.items():
                times[k].append(v)
    phases = {k: median(v) * 1e3 for k, v in times.items()}
    flops = _flops(lv, x, loss_fn)
    fb = (phases["forward"] + phases["backward"]) / 1e3
    return (
        phases,
        _module_table(lv.model, x),
        dict(flops=flops, fwd_bwd_ms=fb * 1e3, flop_per_s=flops / fb if fb > 0 else 0.0),
        _op_table(lv, x, loss_fn, top),
    )


def profile(
    model: torch.nn.Module,
    example_inputs,
    loss_fn=None,
    opt_levels=("O0", "O1", "O2", "O3"),
    half_dtype="auto",
    optimizer: str = "adam",
    lr: float = 1e-3,
    steps: int = 5,
    warmup: int = 2,
    device=None,
    top_ops: int = 15,
) -> ProfileResult:
    """Profile one training step of ``model`` under each opt level.

    Args:
        model: an fp32 model (deep-copied per level; yours is left as it is).
        example_inputs: a tensor or a tuple of positional inputs.
        loss_fn: ``output -> scalar loss`` (default: mean of the squared output).
        opt_levels: the levels to profile; half_dtype: ``"bf16"``, ``"fp16"`` or ``"auto"``.
        optimizer, lr: the optimizer stepped in the ``optimizer_step`` phase.
        steps, warmup: timed and untimed steps per level.
        device: default: where the model's parameters are.

    Returns:
        A :class:`ProfileResult`; a level that fails is left out of the tables and named in
        ``errors`` with its message.

    Example::

        >>> r = mpnb.lab.profile(model, torch.randn(64, 784), opt_levels=("O0", "O2"))
        >>> r.phases.pivot(index="phase", columns="opt_level", values="time_ms")
    """
    p = next(model.parameters(), None)
    dev = resolve_device(device or (p.device if p is not None else "cpu"))
    half = HALF_DTYPES[half_name(half_dtype, dev)]
    x = to_device(example_inputs, dev)
    loss_fn = loss_fn or _default_loss
    phases, modules, flops, ops, errors = [], [], [], [], {}
    for level in opt_levels:
        try:
            ph, mods, fl, op = _profile_level(
                model, x, loss_fn, level, half, optimizer, lr, dev, steps, warmup, top_ops
            )
        except Exception as e:  # noqa: BLE001 - one failing level must not lose the others
            errors[level] = describe_error(e)
            continue
        phases += [dict(opt_level=level, phase=k, time_ms=ph[k]) for k in PHASES]
        modules += [dict(opt_level=level, **m) for m in mods]
        flops.append(dict(opt_level=level, **fl))
        ops += [dict(opt_level=level, **o) for o in op]
    cols = (
        ["opt_level", "phase", "time_ms"],
        ["opt_level", "module", "type", "time_ms", "output_mib", "output_dtype"],
        ["opt_level", "flops", "fwd_bwd_ms", "flop_per_s"],
        ["opt_level", "op", "calls", "self_cpu_ms", "cpu_total_ms"],
    )
    frames = [
        pd.DataFrame(rows, columns=c)
        for rows, c in zip((phases, modules, flops, ops), cols, strict=True)
    ]
    return ProfileResult(*frames, errors)
