"""The built-in workloads sized for a CUDA device, so that the fp32 step computes, not waits.

At the ``medium`` size an H100 runs the GPT's O0 step in 16.2 ms for 719 dispatched ops
(``docs/gpu``): 22.5 us per op, the host's dispatch and launch, with the GPU idle most of
the time. :func:`gpu_plans` sizes each workload from a small description of the device
(:class:`GpuSpec`) with four rules, all arithmetic, so a CPU test can check them:

1. **Busy.** The fp32 step's GPU time ``G = flops / (BUSY_FRACTION * peak)`` must be at least
   ``BUSY_MARGIN`` (2) times its host time ``H = ops * HOST_US_PER_OP``. A steady-state step
   reads nothing on the host, so the host enqueues ahead of the GPU and the step takes
   ``max(G, H)``: busy is about ``G / max(G, H)``, close to 1 with a 2x margin, which covers
   the profiler's own cost per op and runs of small kernels (were there no overlap at all,
   busy would still be ``G / (G + H) >= 0.67``). ``BUSY_FRACTION`` (0.6) is the upper end of
   what fp32 GEMMs reach: assuming more speed makes ``G`` smaller, so this errs towards busy.
2. **Memory.** A default ``mpnb compare`` holds ``N_CONFIGS`` (6) configurations at once, each
   counted with its model, gradients, master weights and Adam state (``STATE_BYTES`` = 20 per
   parameter, O2's) *and* a full fp32 step's activations, in at most ``MEMORY_FRACTION``
   (0.6) of the card's memory. That is what CUDA graphs keep resident; without them the
   round-robin frees each step's activations before the next configuration's step, so the
   real peak is lower.
3. **Time.** A round (one step of each configuration) costs the fp32 step at
   ``TIME_FRACTION`` (0.4, a training run's typical share of peak; fewer FLOP/s make it
   longer, so this errs towards slow) plus five mixed-precision steps, each
   ``max(flops at 0.4 of the half peak, 1.2 H)`` (the casts add ~20% more ops). Steps are
   what fits ``LOOP_S`` (75 s) of rounds, 30 to 150; ``FIXED_S`` (30 s) adds the start
   (CUDA, kernel compiles, data) and the evaluation, for the total under 3 minutes.
4. **Shape.** The GPT keeps 1024 tokens per sequence and 128 per head, takes the widest
   width of :data:`WIDTHS` whose busy batch fits 12 layers (else 4, else the narrowest), and
   the batch that rule 1 asks for; the CNN (64x64 digits, width 256) and the MLP (64x64
   digits, batch 512) take the batch, respectively the hidden width, that rule 1 asks for,
   halved until rule 2 holds.

For an H100 SXM (67 TFLOP/s fp32 and 989 TFLOP/s bf16 dense, 85 GB, 22.5 us per op) the GPT
comes out at width 1024, 12 layers, 8 heads, 1024 tokens, batch 4: 152 M parameters, so
``6 * 152e6 * 4096`` tokens = 3.74 TFLOP of dense layers plus ``12 * layers * b * t^2 * d``
= 0.62 TFLOP of attention = 4.36 TFLOP per step. ``G`` = 109 ms at 60% of the fp32 peak,
``H`` = 12 layers * 180 ops * 22.5 us = 49 ms: 2.2x, busy ~1 when the host runs ahead (0.69
without any overlap). Memory: 3.0 GB of state and 5.1 GB of activations per configuration,
48.9 GB for six (57% of the card). Time: 163 ms for O0, 58 ms for each of the five host-bound
mixed configurations (their 11 ms of tensor-core math hides under the host's dispatch: their
own busy is low, which the ``gpu busy`` column shows), 0.45 s per round, 150 steps, 98 s in
all. The CNN (width 256, batch 256; cuDNN runs its fp32 convolutions in TF32, 494 TFLOP/s):
2.8 TFLOP, ``G`` = 9.4 ms against ``H`` = 200 ops = 4.5 ms, 32.6 GB for six. The MLP (hidden
32768, batch 512): 0.28 TFLOP, ``G`` = 6.9 ms against ``H`` = 1.8 ms, 23.8 GB for six.
:func:`gpu_plans` gives these numbers for any :class:`GpuSpec`.

Example::

    >>> plan = gpu_plans(GpuSpec("NVIDIA H100 80GB HBM3", 85_000_000_000, (9, 0), 132))
    >>> plan["transformer"].spec["d"], plan["transformer"].spec["layers"]
    (1024, 12)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["GpuSpec", "GpuPlan", "gpu_plans", "peak_tflops", "HOST_US_PER_OP", "N_CONFIGS"]

#: host cost of one eager op (Python, dispatcher, launch), us: the medium GPT's O0 step on an
#: H100 took 16.2 ms for 719 ops, host-bound (docs/gpu, the a466a83 run)
HOST_US_PER_OP = 22.5
#: ops dispatched per step: the GPT per layer (719 ops / 4 layers on the H100, embeddings,
#: loss and optimizer included), the 3-block CNN and the 2-layer MLP (counted on a CPU)
OPS = {"layer": 180, "cnn": 200, "mlp": 80}
#: the rules of the module docstring: busy (1), memory (2) and time (3)
BUSY_MARGIN, BUSY_FRACTION = 2.0, 0.6
N_CONFIGS, STATE_BYTES, MEMORY_FRACTION = 6, 20, 0.6
TIME_FRACTION, MIXED_OPS = 0.4, 1.2
LOOP_S, FIXED_S, STEPS = 75.0, 30.0, (30, 150)
_ROUND_MAX = LOOP_S / STEPS[0]  # a round longer than this leaves too few steps
#: the GPT's widths, widest first, and its tokens per sequence and per head
WIDTHS = (2048, 1536, 1024, 768, 512)
SEQ, HEAD_DIM, LAYERS = 1024, 128, 12
BATCHES = (1, 2, 4, 8, 16, 32, 64)
VOCAB_BOUND = 64  # the generated text has 48 words; the embeddings are a rounding error


@dataclass(frozen=True)
class GpuSpec:
    """What the sizing reads of a CUDA device.

    Args:
        name: as ``torch.cuda.get_device_name`` says it (``"NVIDIA H100 80GB HBM3"``).
        total_memory: bytes.
        capability: ``(major, minor)``.
        sm_count: streaming multiprocessors.
        conv_tf32: cuDNN runs fp32 convolutions in TF32 (torch's default,
            ``torch.backends.cudnn.allow_tf32``; Ampere and later only).

    Example::

        >>> GpuSpec.of("cuda")  # on a GPU
        >>> GpuSpec("NVIDIA T4", 15_800_000_000, (7, 5), 40)
    """

    name: str
    total_memory: int
    capability: tuple[int, int] = (9, 0)
    sm_count: int = 132
    conv_tf32: bool = True

    @classmethod
    def of(cls, device="cuda") -> GpuSpec:
        """The description of a real CUDA device (``torch.cuda.get_device_properties``)."""
        import torch  # only here: the sizing itself needs no torch

        p = torch.cuda.get_device_properties(device)
        return cls(
            p.name,
            int(p.total_memory),
            (p.major, p.minor),
            p.multi_processor_count,
            bool(torch.backends.cudnn.allow_tf32),
        )


def peak_tflops(gpu: GpuSpec) -> dict[str, float | str]:
    """Dense peaks, TFLOP/s: ``fp32`` (CUDA cores), ``conv`` (fp32 convolutions: TF32 where
    cuDNN uses it) and ``half`` (fp16/bf16 tensor cores), and ``source``.

    Published (:data:`mpnb.lab.gpu_estimate.GPU_PEAKS`) for a known card; otherwise estimated:
    ``SMs * fp32 lanes (64 or 128) * 2 * 1.5 GHz``, half at 8x that from capability 7.0.

    Args:
        gpu: the device.

    Example::

        >>> peak_tflops(GpuSpec("NVIDIA H100 80GB HBM3", 85_000_000_000))["fp32"]
        67.0
    """
    from mpnb.lab.gpu_estimate import CARD_NAMES, GPU_PEAKS  # the one table of published peaks

    key = next((k for pattern, k in CARD_NAMES if re.search(pattern, gpu.name)), None)
    if key is not None:
        p = GPU_PEAKS[key]
        fp32, half = p["fp32"], p["fp16"] or p["fp32"]
        source = f"published ({key})"
    else:
        lanes = 128 if tuple(gpu.capability) >= (8, 6) else 64  # fp32 lanes per SM
        fp32 = gpu.sm_count * lanes * 2 * 1.5e9 / 1e12
        half = 8 * fp32 if gpu.capability >= (7, 0) else fp32
        source = f"estimated ({gpu.sm_count} SMs)"
    tf32 = gpu.conv_tf32 and gpu.capability >= (8, 0)
    return dict(fp32=fp32, conv=max(fp32, half / 2) if tf32 else fp32, half=half, source=source)


@dataclass(frozen=True)
class GpuPlan:
    """One workload's sizes for a device, with the estimates that chose them.

    Attributes: ``spec`` (the sizes, as in :data:`mpnb.lab.workloads.SIZES_SPEC`), ``flops``
    (per step), ``gpu_ms`` (fp32 at ``BUSY_FRACTION``), ``host_ms``, ``memory_bytes`` (the
    ``N_CONFIGS`` resident), ``round_s`` and ``compare_s`` (a default compare) and ``why``.
    """

    workload: str
    spec: dict
    flops: float
    gpu_ms: float
    host_ms: float
    memory_bytes: float
    round_s: float
    compare_s: float
    why: str = ""

    @property
    def busy(self) -> float:
        """The fp32 step's estimated busy fraction, host and GPU overlapping."""
        return self.gpu_ms / max(self.gpu_ms, self.host_ms)


def _round_s(flops: float, host_s: float, rate32: float, half: float) -> float:
    fp32 = max(flops / (TIME_FRACTION * rate32 * 1e12), host_s)
    mixed = max(flops / (TIME_FRACTION * half * 1e12), MIXED_OPS * host_s)
    return fp32 + (N_CONFIGS - 1) * mixed


def _plan(workload, spec, flops, host_s, mem, rate32, peaks, why="") -> GpuPlan:
    rnd = _round_s(flops, host_s, rate32, peaks["half"])
    lo, hi = STEPS
    steps = max(lo, min(hi, int(LOOP_S / rnd) // 10 * 10))
    spec = {**spec, "steps": steps}
    gpu_ms = flops / (BUSY_FRACTION * rate32 * 1e12) * 1e3
    total = steps * rnd + FIXED_S
    return GpuPlan(workload, spec, flops, gpu_ms, host_s * 1e3, mem, rnd, total, why)


def _busy_enough(flops: float, host_s: float, rate32: float) -> bool:
    return flops / (BUSY_FRACTION * rate32 * 1e12) >= BUSY_MARGIN * host_s


def _gpt(d: int, layers: int, b: int) -> tuple[float, float, float]:
    """FLOPs, one configuration's bytes (state + activations) and host seconds of a step."""
    h, t = max(1, d // HEAD_DIM), SEQ
    params = layers * (12 * d * d + 13 * d) + (2 * VOCAB_BOUND + t) * d
    flops = 6 * params * b * t + 12 * layers * b * t * t * d  # dense layers + attention
    # per layer: x, ln1, qkv (3d), attention out, residual, ln2, fc1 (4d), gelu (4d) and the
    # softmax's probabilities; plus one layer's scores and probabilities in flight
    act = 4 * b * t * layers * (16 * d + h * t) + 4 * 2 * b * h * t * t
    return flops, STATE_BYTES * params + act, layers * OPS["layer"] * HOST_US_PER_OP * 1e-6


def _gpt_fit(d: int, budget: float, peaks: dict) -> tuple[int, int]:
    """Width ``d``'s busy batch (checked at :data:`LAYERS`: fewer layers only raise the ratio,
    the embeddings' share growing) and the most layers, up to :data:`LAYERS`, that fit
    ``budget`` bytes and a round of at most ``LOOP_S / STEPS[0]`` (0 when none)."""
    rate = peaks["fp32"]
    b = next((b for b in BATCHES if _busy_enough(*_gpt(d, LAYERS, b)[::2], rate)), BATCHES[-1])

    def fits(n: int) -> bool:
        flops, nbytes, host_s = _gpt(d, n, b)
        return nbytes <= budget and _round_s(flops, host_s, rate, peaks["half"]) <= _ROUND_MAX

    return b, max((n for n in range(1, LAYERS + 1) if fits(n)), default=0)


def _transformer(gpu: GpuSpec, peaks: dict) -> GpuPlan:
    budget = MEMORY_FRACTION * gpu.total_memory / N_CONFIGS
    fits = {d: _gpt_fit(d, budget, peaks) for d in WIDTHS}
    # the widest width that takes 12 layers, else 4, else any: the card's memory decides
    d = next((d for need in (LAYERS, 4) for d in WIDTHS if fits[d][1] >= need), None)
    if d is None:  # not 4 layers at a busy batch: the narrowest at batch 1 (busy may be low)
        d = WIDTHS[-1]
        fits[d] = 1, max((n for n in range(1, 5) if _gpt(d, n, 1)[1] <= budget), default=1)
    b, layers = fits[d]
    why = "" if layers >= LAYERS else _memory_note(f"{layers} layer(s)", f"batch {b}")
    flops, one, host_s = _gpt(d, layers, b)
    lr = round(min(1e-3, 3e-4 * 1024 / d), 5)
    spec = dict(d=d, layers=layers, heads=max(1, d // HEAD_DIM), seq=SEQ, batch=b, lr=lr)
    return _plan("transformer", spec, flops, host_s, N_CONFIGS * one, peaks["fp32"], peaks, why)


def _memory_note(what: str, at: str) -> str:
    return (
        f"{what}: more at {at} would not fit {N_CONFIGS} configurations in "
        f"{MEMORY_FRACTION:.0%} of the card's memory"
    )


def _halve_to_fit(value: int, lowest: int, bytes_of, budget: float) -> int:
    while value > lowest and bytes_of(value) > budget:
        value //= 2
    return value


def _cnn(gpu: GpuSpec, peaks: dict) -> GpuPlan:
    side, w, rate = 64, 256, peaks["conv"]
    per_sample = 40.5 * side * side * w * w  # 3 x (9 s^2 w^2 + 4.5 s^2 w^2): fwd + bwd
    params = 9 * (w + 2 * w * w + 4 * w * w) + 80 * w
    host_s = OPS["cnn"] * HOST_US_PER_OP * 1e-6
    need = BUSY_MARGIN * host_s * BUSY_FRACTION * rate * 1e12 / per_sample
    b = min(1024, max(64, 2 ** math.ceil(math.log2(max(need, 1)))))

    def nbytes(b: int) -> float:  # ~5 floats per pixel and channel of the first block
        return N_CONFIGS * (STATE_BYTES * params + 20 * side * side * w * b)

    fit = _halve_to_fit(b, 8, nbytes, MEMORY_FRACTION * gpu.total_memory)
    why = "" if fit == b else _memory_note(f"batch {fit}", f"batch {2 * fit}")
    spec = dict(scale=side // 8, width=w, batch=fit, lr=1e-3)
    return _plan("cnn", spec, per_sample * fit, host_s, nbytes(fit), rate, peaks, why)


def _mlp(gpu: GpuSpec, peaks: dict) -> GpuPlan:
    pixels, b, rate = 64 * 64, 512, peaks["fp32"]
    host_s = OPS["mlp"] * HOST_US_PER_OP * 1e-6
    # no gradient for the input: the first layer costs 4 FLOPs per weight and sample, not 6
    need = BUSY_MARGIN * host_s * BUSY_FRACTION * rate * 1e12 / (b * (4 * pixels + 60))
    hidden = min(32768, max(1024, 2 ** math.ceil(math.log2(max(need, 1)))))

    def nbytes(h: int) -> float:  # state, the step's weight-sized temporaries, 3 activations
        return N_CONFIGS * ((STATE_BYTES + 8) * (pixels + 11) * h + 12 * b * h)

    fit = _halve_to_fit(hidden, 256, nbytes, MEMORY_FRACTION * gpu.total_memory)
    why = "" if fit == hidden else _memory_note(f"hidden {fit}", f"hidden {2 * fit}")
    spec = dict(scale=8, hidden=fit, batch=b, lr=3e-4)
    flops = b * (4 * pixels + 60) * fit
    return _plan("mlp", spec, flops, host_s, nbytes(fit), rate, peaks, why)


def gpu_plans(gpu: GpuSpec) -> dict[str, GpuPlan]:
    """Each built-in workload's sizes for ``gpu``, with the estimates behind them.

    A pure function of ``gpu`` (the module docstring gives the rules and an H100's numbers).

    Args:
        gpu: the device, e.g. ``GpuSpec.of("cuda")``.

    Example::

        >>> plans = gpu_plans(GpuSpec("NVIDIA A100-SXM4-80GB", 85_000_000_000, (8, 0), 108))
        >>> {k: p.spec["batch"] for k, p in plans.items()}
    """
    if gpu.total_memory <= 0:
        raise ValueError(
            f"GpuSpec.total_memory={gpu.total_memory!r}: the sizing needs the card's memory in "
            "bytes (torch.cuda.get_device_properties(device).total_memory)."
        )
    peaks = peak_tflops(gpu)
    return {
        "transformer": _transformer(gpu, peaks),
        "cnn": _cnn(gpu, peaks),
        "mlp": _mlp(gpu, peaks),
    }
