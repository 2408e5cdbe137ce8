"""Troubleshooting a slow mixed-precision step: GEMM shapes for tensor cores, overhead.

PyTorch's AMP recipe lists why a step may gain little from half precision. Two of them are
measured here (the third, inf/NaN in the loss, is :func:`mpnb.lab.trace_overflow`):

* :func:`gemm_shapes`: every matrix multiply and convolution of one forward, its ``(m, n, k)``
  and whether each is a multiple of what tensor cores need (16 bytes: 8 fp16/bf16 values, 16
  FP8 values, 4 tf32 values). Backward GEMMs reuse the same three sizes.
* :func:`step_overhead`: the step at batch ``b`` and at ``factor * b``, round-robin. If the
  time grows much less than the work, most of a step is overhead (Python, op dispatch, kernel
  launches) that half precision cannot shrink: a CPU-bound step, in the recipe's words.

Example::

    >>> mpnb.lab.gemm_shapes(model, x).advice
    >>> print(mpnb.lab.step_overhead(model, x).advice)
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch.utils import benchmark
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from mpnb.core.hardware import cuda_info
from mpnb.lab._train import forward
from mpnb.lab.runner import load_record
from mpnb.lab.stats import loadavg, median, median_ci, per_round_ratios
from mpnb.lab.workloads import default_loss

__all__ = ["ShapeReport", "gemm_shapes", "OverheadReport", "step_overhead", "overhead_share"]

_aten = torch.ops.aten
_GEMMS = {
    _aten.mm.default: "mm",
    _aten.addmm.default: "addmm",
    _aten.bmm.default: "bmm",
    _aten.baddbmm.default: "baddbmm",
    _aten.convolution.default: "convolution",
}


def _mnk(func, args) -> tuple[int, int, int]:
    """``(m, n, k)`` of one GEMM: ``(m, k) @ (k, n)``; a convolution's implicit GEMM has
    ``m`` = batch x output positions, ``n`` = out channels, ``k`` = in channels per group."""
    if func is _aten.convolution.default:
        x, w, groups = args[0], args[1], args[8]
        return x.numel() // x.shape[1] if x.dim() > 1 else 1, w.shape[0], x.shape[1] // groups
    a, b = (args[1], args[2]) if func in (_aten.addmm.default, _aten.baddbmm.default) else args[:2]
    return a.shape[-2], b.shape[-1], a.shape[-1]


class _Gemms(TorchDispatchMode):
    """Records each GEMM's sizes and the innermost module running it."""

    def __init__(self):
        super().__init__()
        self.modules: list[str] = ["(model)"]
        self.rows: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _GEMMS.get(func)
        if name is not None:
            m, n, k = _mnk(func, args)
            self.rows.append(dict(module=self.modules[-1], op=name, m=m, n=n, k=k))
        return func(*args, **(kwargs or {}))


@dataclass
class ShapeReport:
    """What :func:`gemm_shapes` found.

    Attributes:
        dtype: the GEMM dtype the sizes were judged for.
        multiple: the size tensor cores want for it (16 bytes of elements).
        table: one row per GEMM of the forward: module, op, m, n, k, ``aligned`` and
            ``pad`` (the sizes to round up, ``"-"`` when none).
        tensor_cores: whether the device the report was made for has tensor cores.
        advice: what to change, in one paragraph.
    """

    dtype: torch.dtype
    multiple: int
    table: pd.DataFrame = field(repr=False)
    tensor_cores: bool = False
    advice: str = ""

    @property
    def misaligned(self) -> pd.DataFrame:
        """The rows with a size that is not a multiple of :attr:`multiple`."""
        return self.table[~self.table.aligned]


def _pad(row, q: int) -> str:
    sizes = [f"{d}={row[d]}->{math.ceil(row[d] / q) * q}" for d in "mnk" if row[d] % q]
    return ", ".join(sizes) or "-"


def gemm_shapes(
    model: torch.nn.Module,
    inputs,
    dtype: torch.dtype = torch.float16,
    multiple: int | None = None,
    device=None,
) -> ShapeReport:
    """Every GEMM of one forward of ``model``, with the sizes tensor cores would want padded.

    One forward of a deep copy under ``torch.no_grad`` (your model is not changed); a
    ``TorchDispatchMode`` records ``mm``/``addmm``/``bmm``/``baddbmm``/``convolution`` and
    module hooks name the innermost module running each.

    Args:
        model: the model (any dtype; sizes do not depend on it).
        inputs: a tensor, tuple (``model(*inputs)``) or dict (``model(**inputs)``).
        dtype: the GEMM dtype to judge for (``torch.float16``, ``bfloat16``, ``float8_*``,
            ``float32`` for tf32).
        multiple: override the wanted multiple (default: 16 bytes of ``dtype``: 8 for
            fp16/bf16, 16 for FP8, 4 for tf32).
        device: the device the model will run on, for the tensor-core sentence (default:
            the model's).

    Example::

        >>> r = gemm_shapes(nn.Linear(100, 1001), torch.randn(64, 100))
        >>> r.misaligned[["module", "m", "n", "k", "pad"]]   # n=1001->1008, k=100->104
    """

    q = multiple or max(1, 16 // torch.empty(0, dtype=dtype).element_size())
    copy_ = copy.deepcopy(model)
    watch, hooks = _Gemms(), []

    def enter(name):
        def hook(mod, args) -> None:
            watch.modules.append(name)

        return hook

    def leave(mod, args, out) -> None:
        watch.modules.pop()

    for name, mod in copy_.named_modules():
        if name:
            hooks.append(mod.register_forward_pre_hook(enter(name)))
            hooks.append(mod.register_forward_hook(leave, always_call=True))
    try:
        with torch.no_grad(), watch:
            forward(copy_, inputs)
    finally:
        for h in hooks:
            h.remove()
    table = pd.DataFrame(watch.rows, columns=["module", "op", "m", "n", "k"])
    table["aligned"] = [all(r[d] % q == 0 for d in "mnk") for _, r in table.iterrows()]
    table["pad"] = [_pad(r, q) for _, r in table.iterrows()]
    p = next(model.parameters(), None)
    dev = torch.device(device or (p.device if p is not None else "cpu"))
    info = cuda_info(dev.index or 0) if dev.type == "cuda" else None
    cores = bool(info and info["tensor_cores"])
    return ShapeReport(dtype, q, table, cores, _shape_advice(table, q, dtype, dev, info))


def _shape_advice(table: pd.DataFrame, q: int, dtype, dev, info) -> str:
    name = str(dtype).replace("torch.", "")
    bad = table[~table.aligned]
    if table.empty:
        head = "no GEMM ran in this forward: nothing for tensor cores to do."
    elif bad.empty:
        head = f"all {len(table)} GEMMs have m, n and k multiples of {q}: tensor-core friendly."
    else:
        where = "; ".join(f"{r.module} ({r.pad})" for _, r in bad.head(4).iterrows())
        more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
        head = (
            f"{len(bad)} of {len(table)} GEMMs have a size that is not a multiple of {q} "
            f"({name}): {where}{more}. Pad them: round hidden sizes and vocabularies up "
            f"(e.g. 1001 -> {math.ceil(1001 / q) * q}), and batch x sequence (m) too."
        )
    if info is None:
        tail = f"{dev} has no tensor cores: the sizes matter when this model runs on a GPU."
    elif info["tensor_cores"]:
        tail = f"{info['name']} has tensor cores: unaligned GEMMs run slower paths there."
    else:
        tail = f"{info['name']} (capability {info['capability']}) has no tensor cores."
    return f"{head} {tail}"


def overhead_share(ratio: float, factor: float) -> float:
    """The share of a step at batch ``b`` that does not grow with the batch (its overhead).

    With ``t(b) = overhead + per_sample * b``, ``ratio = t(factor * b) / t(b)`` gives
    ``overhead / t(b) = (factor - ratio) / (factor - 1)``, clamped to ``[0, 1]``.

    Example::

        >>> overhead_share(1.0, 8)   # 8x the work in the same time: all overhead
        1.0
        >>> overhead_share(8.0, 8)   # the time grows with the work: no overhead
        0.0
    """
    if factor <= 1:
        raise ValueError(f"overhead_share: factor={factor!r} must be > 1 (the batch grows).")
    return min(1.0, max(0.0, (factor - ratio) / (factor - 1)))


@dataclass
class OverheadReport:
    """What :func:`step_overhead` measured.

    Attributes:
        batch, factor: the batch size measured and how many times larger the second one was.
        small_ms, large_ms: median step times at ``batch`` and ``factor * batch``.
        ratio: median of the per-round ratios large / small; ``ratio_ci`` its 95% interval.
        share: :func:`overhead_share` of ``ratio``: the overhead part of a step at ``batch``.
        bound: ``"overhead"`` (share above one half) or ``"compute"``.
        advice: what that means for mixed precision, and what to do.
        load: the machine's load around the measurement (:func:`mpnb.lab.runner.load_record`);
            when other processes competed, waiting for them counts as overhead too.
    """

    batch: int
    factor: int
    small_ms: float
    large_ms: float
    ratio: float
    ratio_ci: tuple[float, float]
    share: float
    bound: str
    advice: str = ""
    load: dict = field(default_factory=dict)


def _batch_of(x) -> int:
    leaves = [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]
    if not leaves or leaves[0].dim() == 0:
        raise ValueError(
            "step_overhead: the inputs hold no batched tensor; pass a tensor (or a tuple or "
            "dict of tensors) whose first dimension is the batch."
        )
    return leaves[0].shape[0]


def step_overhead(
    model: torch.nn.Module,
    inputs,
    loss_fn=None,
    factor: int = 8,
    autocast_dtype: torch.dtype | None = None,
    rounds: int = 7,
) -> OverheadReport:
    """Does a training step's time grow with its work? Forward + backward at ``inputs``'
    batch and at ``factor`` times it, alternated (A, B, A, B...) on a deep copy of ``model``.

    A step whose time hardly grows is bound by overhead (Python, op dispatch, kernel
    launches: "CPU-bound" in PyTorch's AMP recipe): half precision speeds up the math, not
    that, so it gains little there.

    Args:
        model: the model (deep-copied; yours keeps its grads and weights).
        inputs: a batch (tensor, tuple or dict of tensors, batch first); it is repeated
            ``factor`` times along dim 0 for the large step.
        loss_fn: ``output -> scalar loss`` (default: mean of the squared output).
        factor: how many times larger the second batch is.
        autocast_dtype: run the forward under ``torch.autocast`` in this dtype (None: fp32).
        rounds: timed rounds (after one untimed warm-up of each size).

    Returns:
        An :class:`OverheadReport`.

    Example::

        >>> r = step_overhead(nn.Linear(16, 16), torch.randn(8, 16))
        >>> r.bound, r.share > 0.5
        ('overhead', True)
    """

    batch = _batch_of(inputs)
    overhead_share(1.0, factor)  # validates factor before anything runs
    loss_fn = loss_fn or default_loss
    m = copy.deepcopy(model)
    p = next(m.parameters(), None)
    dev = p.device if p is not None else torch.device("cpu")
    big = tree_map(lambda t: torch.cat([t] * factor) if isinstance(t, torch.Tensor) else t, inputs)

    def step(x) -> float:
        m.zero_grad(set_to_none=True)
        t0 = benchmark.timer()
        with torch.autocast(dev.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = loss_fn(forward(m, x))
        loss.float().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return benchmark.timer() - t0

    load_start = loadavg()
    step(inputs), step(big)
    small, large = [], []
    for _ in range(rounds):
        small.append(step(inputs))
        large.append(step(big))
    ratios = per_round_ratios(large, small)
    ratio = median(ratios)
    share = overhead_share(ratio, factor)
    report = OverheadReport(
        batch,
        factor,
        median(small) * 1e3,
        median(large) * 1e3,
        ratio,
        median_ci(ratios),
        share,
        "overhead" if share > 0.5 else "compute",
    )
    report.load = load_record(load_start, loadavg(), torch.get_num_threads(), os.cpu_count() or 1)
    report.advice = _overhead_advice(report, dev)
    return report


def _overhead_advice(r: OverheadReport, dev: torch.device) -> str:
    what = "Python, op dispatch, kernel launches" if dev.type == "cuda" else "Python, op dispatch"
    head = (
        f"{r.factor}x the batch took {r.ratio:.2f}x the time ({r.small_ms:.3g} -> "
        f"{r.large_ms:.3g} ms on {dev.type}): about {r.share:.0%} of a step at batch {r.batch} "
        f"is overhead ({what}), which half precision does not shrink."
    )
    busy = ""
    if r.load.get("competed"):
        load = next((x[0] for x in (r.load["start"], r.load["end"]) if x), math.nan)
        busy = (
            f" Other processes competed for the CPU (load average {load:.1f} on "
            f"{r.load['cpus']} CPUs, {r.load['threads']} thread(s) of ours): waiting for them "
            "counts as overhead here; measure again on a quiet machine."
        )
    if r.bound == "compute":
        return f"{head} The step is compute-bound: faster math (half precision) can help.{busy}"
    return (
        f"{head} The step is overhead-bound: raise the batch or the model size, keep "
        ".item() and printing of device tensors out of the step, and fuse small ops "
        f"(torch.compile, fused optimizers) before expecting a gain from half precision.{busy}"
    )
