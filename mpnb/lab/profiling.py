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
* ``ops``: the ``torch.profiler`` op table of one step (self time, calls); that step's
  trace is kept and :meth:`ProfileResult.export_chrome_trace` writes it for Chrome's
  ``chrome://tracing`` or https://ui.perfetto.dev (``torch.profiler``'s own export);
* when asked (``memory``, ``trace``, ``precision``): the memory breakdown by role, the first
  layer that leaves the half range and the precision each op ran in
  (:mod:`mpnb.lab._profile_extras`).

O0 is plain fp32 training: its step calls ``loss.backward()`` without ``amp.scale_loss`` (no
scaler runs), so it has no ``unscale_and_update`` row; the half levels have one.

The machine's load average at the start and end and the thread count are recorded in
``load`` (as :func:`mpnb.lab.compare` records them): on a busy machine the phase times of
the levels are not comparable, and ``load["note"]`` says so.

Times come from ``torch.utils.benchmark.timer`` (synchronizing CUDA), medians over ``steps``
steps after ``warmup`` untimed ones.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch.utils import benchmark
from torch.utils.flop_counter import FlopCounterMode

from mpnb import amp
from mpnb.core.dtype_names import parse_half_dtype
from mpnb.core.opt_levels import OPT_LEVEL_NAMES, parse_opt_level
from mpnb.core.precision_configs import get_config
from mpnb.lab._errors import describe_error
from mpnb.lab._profile_extras import Extras
from mpnb.lab._train import forward, to_device
from mpnb.lab.config import resolve_device
from mpnb.lab.runner import load_record
from mpnb.lab.stats import loadavg, median, torch_threads
from mpnb.lab.workloads import default_loss

__all__ = ["ProfileResult", "profile", "PHASES"]

PHASES = ("forward", "backward", "unscale_and_update", "optimizer_step")


@dataclass
class ProfileResult:
    """The tables :func:`profile` returns (long format, one ``opt_level`` column each).

    ``memory`` (a :func:`mpnb.lab.compare` frame), ``overflow`` (:func:`trace_overflow`'s
    result) and ``precision`` (:func:`trace_precision`'s) are None unless asked for;
    ``device`` and ``half_dtype`` are what the profile resolved and used.
    """

    phases: pd.DataFrame
    modules: pd.DataFrame
    flops: pd.DataFrame
    ops: pd.DataFrame
    errors: dict = field(default_factory=dict)
    load: dict = field(default_factory=dict)
    traces: dict = field(default_factory=dict, repr=False)
    memory: pd.DataFrame | None = None
    overflow: object = None
    precision: object = None
    device: str = ""
    half_dtype: torch.dtype | None = None

    def export_chrome_trace(self, path: str, opt_level: str | None = None) -> str:
        """Write the ``torch.profiler`` trace of one profiled step (Chrome/Perfetto JSON).

        Args:
            path: the ``.json`` file to write (open it in ``chrome://tracing`` or
                https://ui.perfetto.dev).
            opt_level: which level's step (default: the first profiled).

        Example::

            >>> r = mpnb.lab.profile(model, x, opt_levels=("O0", "O2"))
            >>> r.export_chrome_trace("o2.json", "O2")
        """
        if not self.traces:
            raise RuntimeError(
                "export_chrome_trace: no level was profiled (see .errors); fix the failing "
                "levels and profile again."
            )
        level = opt_level or next(iter(self.traces))
        if level not in self.traces:
            raise ValueError(
                f"export_chrome_trace: {level!r} was not profiled; choose one of "
                f"{sorted(self.traces)}."
            )
        self.traces[level].export_chrome_trace(str(path))
        return str(path)


class _Level:
    """One opt level's copy of the model, its optimizer, scaler and a timed step."""

    def __init__(self, model, level, half, opt_name, lr, device):
        pc = get_config(parse_opt_level(level))
        self.amp = pc.loss_scaling  # O0: plain fp32 training, no unscale phase to time
        self.model = copy.deepcopy(model).to(device)
        opt = pc.make_optimizer(opt_name, self.model.parameters(), lr)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model, self.opt = pc.apply(self.model, opt, half)

    def step(self, x, loss_fn) -> dict[str, float]:
        clock = benchmark.timer
        self.opt.zero_grad(set_to_none=True)
        t0 = clock()
        loss = loss_fn(forward(self.model, x))
        t1 = clock()
        if not self.amp:
            loss.backward()
            t2 = clock()
            self.opt.step()
            return {"forward": t1 - t0, "backward": t2 - t1, "optimizer_step": clock() - t2}
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


def _op_table(lv: _Level, x, loss_fn, top: int):
    # torch.profiler only when a trace is recorded
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    # Kineto prints "USDT: ... profiler_start/stop" lines to stderr at its default log level;
    # its level is read once, at the first profile of the process (a user's setting wins).
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=acts) as prof:
        lv.step(x, loss_fn)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    rows = [
        dict(
            op=e.key,
            calls=e.count,
            self_cpu_ms=e.self_cpu_time_total / 1e3,
            cpu_total_ms=e.cpu_time_total / 1e3,
        )
        for e in events[:top]
    ]
    return rows, prof


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
    ops, prof = _op_table(lv, x, loss_fn, top)
    return (
        phases,
        _module_table(lv.model, x),
        dict(flops=flops, fwd_bwd_ms=fb * 1e3, flop_per_s=flops / fb if fb > 0 else 0.0),
        ops,
        prof,
    )


def profile(
    model: torch.nn.Module,
    example_inputs,
    loss_fn=None,
    opt_levels=OPT_LEVEL_NAMES,  # amp's phases are timed: Apex's levels (no peers)
    half_dtype="auto",
    optimizer: str = "adam",
    lr: float = 1e-3,
    steps: int = 5,
    warmup: int = 2,
    device=None,
    top_ops: int = 15,
    on_progress=None,
    *,
    memory: bool = False,
    trace: bool = False,
    precision: str | None = None,
    threads: int | None = None,
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
        top_ops: rows of the op table per level.
        on_progress: called as ``on_progress(what, done, total)`` before each level (``what``
            the level), before each extra (``what`` says which) and once at the end (``what``
            None), e.g. to move a progress bar.
        memory: also measure the memory breakdown by role (a 3-step :func:`mpnb.lab.compare`
            run of your model and inputs): ``result.memory``.
        trace: also run :func:`mpnb.lab.trace_overflow` in the half dtype: ``result.overflow``.
        precision: also run :func:`mpnb.lab.trace_precision` of this configuration
            (``"auto"``: the first level other than O0; None: not traced):
            ``result.precision``.
        threads: ``torch.set_num_threads`` while profiling (restored after; None: unchanged);
            more than the machine's CPUs warns, since the times then mislead.

    ``example_inputs`` may be a dict (``model(**inputs)``, e.g. a ``transformers`` batch with
    ``labels``), and the model may return a tensor, tuple, dict, dataclass or ``ModelOutput``:
    ``loss_fn`` receives exactly what the model returned, under every level (for a
    ``transformers`` model, ``loss_fn=mpnb.lab.hf.hf_loss`` reads the loss it computed).

    Returns:
        A :class:`ProfileResult`; a level that fails is left out of the tables and named in
        ``errors`` with its message.

    Example::

        >>> r = mpnb.lab.profile(model, torch.randn(64, 784), opt_levels=("O0", "O2"))
        >>> r.phases.pivot(index="phase", columns="opt_level", values="time_ms")
    """
    p = next(model.parameters(), None)
    dev = resolve_device(device or (p.device if p is not None else "cpu"))
    half = parse_half_dtype(half_dtype, dev)
    if threads is not None and threads > (os.cpu_count() or 1):
        warnings.warn(
            f"profile: threads={threads} is more than this machine's {os.cpu_count()} CPUs: "
            "threads will wait for each other and the times mislead; use at most that many.",
            stacklevel=2,
        )
    levels = tuple(opt_levels)
    extras = Extras(memory, trace, precision, levels)
    total = len(levels) + extras.count
    progress = on_progress or (lambda what, done, n: None)
    loss_fn = loss_fn or default_loss
    with torch_threads(threads):
        result = _profile(
            model,
            example_inputs,
            loss_fn,
            levels,
            half,
            dev,
            optimizer=optimizer,
            lr=lr,
            steps=steps,
            warmup=warmup,
            top_ops=top_ops,
            step=lambda level, i: progress(level, i, total),
        )
        extras.run(
            model,
            example_inputs,
            loss_fn,
            half,
            optimizer,
            lr,
            dev,
            lambda what, i: progress(what, len(levels) + i, total),
        )
    progress(None, total, total)
    result.errors.update(extras.errors)
    result.memory, result.overflow = extras.frame, extras.overflow
    result.precision, result.device, result.half_dtype = extras.precision_trace, dev, half
    return result


def _profile(
    model,
    example_inputs,
    loss_fn,
    levels,
    half,
    dev,
    *,
    optimizer,
    lr,
    steps,
    warmup,
    top_ops,
    step,
) -> ProfileResult:
    """The levels' phases, modules, FLOPs and ops (what :func:`profile` always measures);
    ``step(level, done)`` is called before each level."""

    x = to_device(example_inputs, dev)
    phases, modules, flops, ops, errors, traces = [], [], [], [], {}, {}
    load_start = loadavg()
    for i, level in enumerate(levels):
        step(level, i)
        try:
            ph, mods, fl, op, traces[level] = _profile_level(
                model, x, loss_fn, level, half, optimizer, lr, dev, steps, warmup, top_ops
            )
        except Exception as e:  # noqa: BLE001 - one failing level must not lose the others
            errors[level] = describe_error(e)
            continue
        phases += [dict(opt_level=level, phase=k, time_ms=ph[k]) for k in PHASES if k in ph]
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
    load = load_record(load_start, loadavg(), torch.get_num_threads(), os.cpu_count() or 1)
    return ProfileResult(*frames, errors, load, traces)
