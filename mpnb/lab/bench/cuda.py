"""Triton GPU kernels vs PyTorch's CUDA path: ratios with 95% intervals, % of copy bandwidth.

Run with ``mpnb bench --device cuda`` (needs a GPU). Each case times one of mpnb's Triton
kernels (called through its launcher, so ``MPNB_TRITON`` does not matter here) against the
fastest path PyTorch offers for the same work on CUDA, round-robin in one process, beside the
device copy ``a.copy_(b)`` (``x.sum()`` for the read-only L2 norm) timed in the same rounds:

* **lists**, on a small GPT's grads (20M elements in 76 tensors) and on the large size: the
  inf/NaN check of bf16 and fp16 grads (``multi_tensor_check_finite``), the
  unscale of bf16 grads into fp32 (``_foreach_copy_`` + ``_amp_foreach_non_finite_check_and_
  unscale_``), the L2 norm (``_foreach_norm``), the O2 optimizer steps on bf16 params with fp32
  masters against the op's PyTorch path (AdamW ``torch._fused_adamw_``, SGD ``torch._fused_sgd_``,
  each with the unscale and the cast back; LAMB in ``torch._foreach_*`` ops: PyTorch has no
  fused LAMB), the pure-bf16 steps with stochastic rounding (``fused_{adam,sgd,lamb}_bf16_``)
  against mpnb's reference in PyTorch ops (what their CUDA calls run without the kernel:
  PyTorch has no stochastic rounding), and the whole **O2 step** (bf16, and fp16 at the GPT
  size): torch.amp's ``_amp_foreach_non_finite_check_and_unscale_`` into fp32 master grads +
  ``_fused_adamw_`` + the cast (48 B/param) against what mpnb's amp O2 step with ``FusedAdam``
  launches (the inf/NaN check, then the one-pass Triton AdamW), target 1.5x;
* **layers** in bf16 at the sizes of the GPT that ``mpnb compare --size auto`` trains on this
  card (:mod:`mpnb.lab.gpu_sizing`: ``[batch * seq, d]`` rows, ``[batch, heads, seq, seq]``
  scores, ``[seq, batch, heads, 128]`` for RoPE) and at the large size: layer norm and RMS norm
  forward and backward (``F.layer_norm``, ``F.rms_norm``, ``aten.native_layer_norm_backward``,
  ``aten._fused_rms_norm_backward``), the plain, padding-masked and causal scaled softmax and
  its backward (``softmax(masked_fill(x * s))``, ``aten._softmax_backward_data``), and RoPE
  (PyTorch ops, as mpnb's reference).

**The large size** is :data:`LARGE_ELEMS` elements of the case's main input (``2**27``: 256 MiB
in bf16, far beyond any GPU's L2): a list of 64 tensors, or the layer shapes with their first
dimension grown. It is left out by ``--quick``, and a workload that would not fit in this GPU's
free memory (its estimate: :data:`BYTES_PER_ELEM`) gives one ``SKIPPED`` row saying so.

**Rounds**: at least ``--rounds`` (15), then 5 more at a time until every ratio's 95% interval
(bootstrap of the per-round ratios, :func:`mpnb.lab.stats.median_ci`) is within 2% of it, at
most 40 rounds or 1 s of rounds per case (:data:`~mpnb.lab.bench._cuda_layers.ENOUGH`), in
5 ms rounds. Expected time on an H100 (an estimate from the case count and the rule, not yet
measured): 40-50 s, ~17 s of rounds (40 cases; at most 40 s by the rule), the Triton compiles
and autotuning at the first call of each kernel (not timed) and the start.

``bytes`` is the least traffic of the operation (each input read once, each output written
once), the same for both sides; ``% bw`` is that over the time, as a share of the same-run
copy bandwidth. A kernel is on by default only where the lower end of every one of its cases'
intervals is at least 1.0 (:mod:`mpnb.core.ops.triton._decision`, written by
``scripts/gpu-check.sh`` from this suite's JSON).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from mpnb.lab.bench._cuda_layers import norm_cases, rope_case, softmax_cases
from mpnb.lab.bench._cuda_lists import list_cases
from mpnb.lab.bench._harness import Candidate, Case, Options, Row
from mpnb.lab.bench.multi_tensor import gpt_numels

__all__ = [
    "BYTES_PER_ELEM",
    "COLUMNS",
    "LARGE_ELEMS",
    "LARGE_TAG",
    "cases",
    "memory_skip",
    "shapes",
    "summary",
    "unavailable",
]

#: The large size: elements of a case's main input (256 MiB of bf16).
LARGE_ELEMS = 1 << 27
#: How the large size's workload labels start.
LARGE_TAG = "(L) "
#: GPU memory a workload holds per element of its size, an upper estimate: lists 64 bytes (the
#: bf16 grads, both sides' fp32 masters and moments and half params, fp32 grad copies, LAMB's
#: temporaries, the two fp32 bandwidth buffers), layers 32 (inputs, both sides' outputs and
#: temporaries, the bandwidth buffers).
BYTES_PER_ELEM = {"lists": 64, "layers": 32}
#: The table's columns (titles of :data:`mpnb.lab.bench._report.COLUMN_TITLES`).
COLUMNS = (
    "case",
    "candidate",
    "median",
    "vs PyTorch",
    "95% CI",
    "rounds",
    "GB/s",
    "% bw",
    "status",
)
_GPT_LIST = "(a) GPT 20M/76"
_ROPE_DIM = 128


def unavailable(opts: Options) -> str | None:
    """Why this suite cannot run with ``opts`` here (None when it can)."""
    try:
        dev = torch.device(opts.device)
    except RuntimeError as e:
        return f"--device {opts.device!r} is not a device torch knows ({e})."
    if dev.type != "cuda":
        return (
            "the cuda suite measures GPU kernels and needs a CUDA GPU: run "
            "`mpnb bench --device cuda` on a machine with one."
        )
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        return (
            f"--device {opts.device}: no CUDA GPU is visible to torch {torch.__version__} "
            f"({build}); run on a machine with an NVIDIA GPU and a CUDA build of torch."
        )
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton cannot be imported ({e}): pip install triton (Linux)."
    return None


def shapes(gpt: dict, scale: float = 1.0, elems: int | None = None) -> dict:
    """The layer cases' shapes for a GPT (``d``, ``heads``, ``seq``, ``batch`` as in
    :mod:`mpnb.lab.gpu_sizing`): its own, times ``scale``, or, with ``elems``, each shape's
    first dimension grown until it holds at least ``elems`` elements.

    Example::

        >>> shapes(dict(d=1024, heads=8, seq=1024, batch=4))["norm"]
        (4096, 1024)
        >>> shapes(dict(d=1024, heads=8, seq=1024, batch=4), elems=1 << 27)["softmax"]
        (16, 8, 1024, 1024)
    """
    d, h, t, b = gpt["d"], gpt["heads"], gpt["seq"], gpt["batch"]
    if elems is None:
        rows, seq = max(1, round(b * t * scale)), max(8, round(t * scale**0.5))
        return dict(norm=(rows, d), softmax=(b, h, seq, seq), rope=(rows // b or 1, b, h, 128))
    grow = lambda rest: math.ceil(elems / rest)  # noqa: E731 - one line, used thrice
    return dict(
        norm=(grow(d), d),
        softmax=(grow(h * t * t), h, t, t),
        rope=(grow(b * h * _ROPE_DIM), b, h, _ROPE_DIM),
    )


def _gpt(dev: str) -> dict:
    """The GPT ``mpnb compare --size auto`` trains on this card."""
    from mpnb.lab.gpu_sizing import GpuSpec, gpu_plans

    return gpu_plans(GpuSpec.of(dev))["transformer"].spec


def _layers(shape: dict, dev: str, tag: str = "") -> Iterator[Case]:
    yield from norm_cases(*shape["norm"], dev, tag)
    yield from softmax_cases(*shape["softmax"][:3], dev, tag)
    yield rope_case(*shape["rope"], dev, tag)


def memory_skip(need: int, dev: str) -> str:
    """Why a workload holding about ``need`` bytes cannot run on ``dev`` now ("" when it can:
    it fits in 90% of the GPU's free memory, measured after emptying torch's cache)."""
    if torch.device(dev).type != "cuda":
        return ""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(torch.device(dev))
    if need <= 0.9 * free:
        return ""
    return (
        f"needs about {need / 2**30:.1f} GiB of GPU memory, {free / 2**30:.1f} GiB free of "
        f"{total / 2**30:.0f} GiB: the large size runs on a card with more free memory"
    )


def _if_it_fits(work: str, need: int, dev: str, make: Callable[[], Iterator[Case]]):
    why = memory_skip(need, dev)
    if why:
        yield Case("every case", work, [Candidate("not run", lambda: None)], skipped=why)
        return
    yield from make()


def cases(opts: Options) -> Iterator[Case]:
    """Yield the cases one workload at a time (one workload's tensors alive at once): the GPT
    sizes, then (outside ``--quick``) the large size."""
    why = unavailable(opts)
    if why:
        raise RuntimeError(why)
    dev, gpt = opts.device, _gpt(opts.device)
    yield from list_cases(_GPT_LIST, [max(1, round(k * opts.scale)) for k in gpt_numels()], dev)
    yield from _layers(shapes(gpt, opts.scale), dev)
    if opts.quick:
        return
    big = max(64, round(LARGE_ELEMS * opts.scale))
    work = f"{LARGE_TAG}64x{big // 64}"
    need = big * BYTES_PER_ELEM["lists"]
    yield from _if_it_fits(work, need, dev, lambda: list_cases(work, [big // 64] * 64, dev, False))
    large, need = shapes(gpt, elems=big), big * BYTES_PER_ELEM["layers"]
    layers = f"{LARGE_TAG}layers of {big} elements"
    yield from _if_it_fits(layers, need, dev, lambda: _layers(large, dev, LARGE_TAG))


def summary(rows: list[Row]) -> list[str]:
    """Per kernel, the decision the measured rule would make from this run (the lower end of
    every case's interval at least 1.0), the kernels with no case here, and skipped cases."""
    from mpnb.core.ops.triton import LAUNCHERS

    worst: dict[str, float] = {}
    for r in rows:
        if r.role == "candidate" and r.candidate.startswith("triton ") and r.ratio is not None:
            op = r.candidate.split()[1]
            lo = r.ratio_lo if r.ratio_lo is not None else float("-inf")
            worst[op] = min(worst.get(op, lo), lo)
    on = sorted(op for op, lo in worst.items() if lo >= 1.0)
    off = sorted(op for op in worst if op not in on)
    lines = [
        f"at least PyTorch's speed, the 95% interval's lower end included, on every case: "
        f"{', '.join(on) or 'none'}",
        f"below it on some case (opt-in): {', '.join(off) or 'none'}",
    ]
    missing = [op for op in LAUNCHERS if op not in worst]
    if missing:
        lines.append(f"not measured in this run: {', '.join(missing)}")
    lines += [f"skipped {r.workload}: {r.error}" for r in rows if r.status == "SKIPPED"]
    return lines
