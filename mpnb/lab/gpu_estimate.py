"""An ESTIMATE, not a measurement: what a GPU of :data:`GPU_PEAKS` would show for each row of a
:func:`mpnb.lab.compare` DataFrame measured elsewhere (a CPU run, usually).

Per row and GPU the step has three parts, each from what the run counted:

* **host time** ``H = ops * HOST_US_PER_OP``: eager PyTorch dispatches every op from Python
  and launches its kernel; ``ops`` is the row's ``ops_per_step``.
* **GPU time** ``G = max(ops * KERNEL_FLOOR_US, compute + memory)``, where
  ``compute = flops / (peak[gemm dtype] * COMPUTE_FRACTION)`` and
  ``memory = bytes / (bandwidth * MEMORY_FRACTION)``: every kernel takes at least the floor,
  and the GEMMs and the streaming kernels of a step run one after another on one stream, so
  their roofline times add. ``bytes`` is twice the step's tensors (the ``mem_<role>_mib``
  columns): each is written and read about once.
* **host syncs** ``s``: the row's ``host_syncs_per_step`` (device-to-host reads counted by the
  lab). A missing or NaN count is unknown: it is estimated as 0 and ``syncs_known`` says so.

Host and GPU overlap while nothing syncs: the host issues kernels ahead of the GPU, and the next
step's dispatch overlaps this step's kernels. The ``s`` syncs split the step into ``s + 1``
segments, each an equal share ``h = H / (s+1)``, ``g = G / (s+1)`` (where the reads sit is not
counted; equal shares are the neutral guess). The last segment overlaps the next step and takes
``max(h, g)``. A segment that ends in a sync takes ``max(h, g)`` and then drains: at the sync the
host waits for the GPU to run what it queued, and after it the GPU waits for the host's next
launches, so that segment's host and GPU shares do not overlap: ``h + g``. Summed::

    t = s * (h + g) + max(h, g) = max(H, G) + s / (s + 1) * min(H, G)

which is exactly ``max(H, G)`` without syncs and approaches ``H + G`` as they multiply. This is
the pessimistic end of a sync's cost (a GPU that keeps up with the host drains in a few
microseconds); the H100 runs in ``docs/gpu`` measured more than it (below). The sync of the lab's
timer at each timed step's end is not counted: a training loop has none.

``bound`` names what limits the step: ``"host syncs"`` when the syncs add at least the larger
side's lead (``s/(s+1) * min(H, G) >= |H - G|``), else ``"host dispatch"`` when ``H >= G``,
else the larger of ``"compute"`` and ``"memory"``. (A GPU held up by its floor alone is never
the limit: the floor per op is below the host's cost per op.)

Calibration (``docs/gpu``, the lab's GPT: width 128, 4 layers, 128 tokens, batch 32, on an H100
SXM): O0 took 16.2 ms for 719 ops with no sync, host-bound (its ``G`` is about 2.2 ms), hence
:data:`HOST_US_PER_OP`. O3 bf16 took 27.5 ms for 721 ops and one sync; this model gives 17.3 ms,
so one host read there cost more than the drain. ``ops_per_step`` is counted where the lab ran:
a CPU run counts torch.optim's per-parameter loop where CUDA takes its foreach path (368 more
ops for that GPT at every level), which adds the same host time to every row of that optimizer.

Example::

    >>> est = estimate_for_card(cpu_df, torch.cuda.get_device_name())
    >>> est[["configuration", "est_step_ms", "est_speedup_vs_O0", "bound"]]
"""

from __future__ import annotations

import math
import re

import pandas as pd

from mpnb.core.precision_configs import BASELINE, get_config
from mpnb.lab.memory import ROLES as _ROLES

__all__ = [
    "CARD_NAMES",
    "COLUMNS",
    "COMPUTE_FRACTION",
    "GPU_PEAKS",
    "HOST_US_PER_OP",
    "KERNEL_FLOOR_US",
    "MEMORY_FRACTION",
    "REFERENCE_GPU",
    "card_key",
    "estimate_for_card",
    "gpu_estimate",
    "step_time",
]

#: Published dense peaks (vendor data sheets, no sparsity): TFLOP/s for fp32 (CUDA cores),
#: fp16, bf16 and fp8 (tensor cores, fp32 accumulate), and memory bandwidth in GB/s.
#: ``None``: the dtype has no tensor-core support there (the fp32 rate is used).
GPU_PEAKS = {
    "NVIDIA T4": dict(fp32=8.1, fp16=65.0, bf16=None, fp8=None, gbps=320.0),
    "NVIDIA V100 SXM2": dict(fp32=15.7, fp16=125.0, bf16=None, fp8=None, gbps=900.0),
    "NVIDIA A100 SXM 80GB": dict(fp32=19.5, fp16=312.0, bf16=312.0, fp8=None, gbps=2039.0),
    "NVIDIA L4": dict(fp32=30.3, fp16=121.0, bf16=121.0, fp8=242.5, gbps=300.0),
    "NVIDIA RTX 4090": dict(fp32=82.6, fp16=165.2, bf16=165.2, fp8=330.3, gbps=1008.0),
    "NVIDIA H100 SXM": dict(fp32=67.0, fp16=989.0, bf16=989.0, fp8=1979.0, gbps=3350.0),
    "NVIDIA H200 SXM": dict(fp32=67.0, fp16=989.0, bf16=989.0, fp8=1979.0, gbps=4800.0),
}
#: a GPU's name as torch reports it -> its :data:`GPU_PEAKS` entry (the first match wins)
CARD_NAMES = (
    (r"H200", "NVIDIA H200 SXM"),
    (r"H100(?!.*(PCIe|NVL))", "NVIDIA H100 SXM"),
    (r"A100(?!.*PCIe)", "NVIDIA A100 SXM 80GB"),
    (r"\bL4\b", "NVIDIA L4"),
    (r"RTX 4090", "NVIDIA RTX 4090"),
    (r"V100", "NVIDIA V100 SXM2"),
    (r"\bT4\b", "NVIDIA T4"),
)
REFERENCE_GPU = "NVIDIA A100 SXM 80GB"

#: host cost of one eager op (Python, dispatcher, kernel launch), microseconds: the lab's O0
#: GPT step on an H100 took 16.2 ms for 719 ops and was host-bound (docs/gpu, a466a83 run).
#: One constant for every card: it is the host's cost, not the GPU's, and no other host was
#: measured (a per-card number would be invented).
HOST_US_PER_OP = 22.5
#: GPU time of a kernel too small to fill the GPU, microseconds: an empty kernel takes about 3 us
#: from launch to completion on recent NVIDIA GPUs and drivers (NVIDIA developer forum
#: measurements). Each op counts as one kernel: views launch none, a few ops launch several.
KERNEL_FLOOR_US = 3.0
#: share of the tensor-core / CUDA-core peak a training step reaches: the model FLOPs
#: utilisation of Llama 3 405B's pre-training on H100s, 38-43% (Dubey et al., 2024)
COMPUTE_FRACTION = 0.4
#: share of the data-sheet bandwidth a step's streaming kernels reach: an assumption (large
#: copies reach 80-90% on HBM; a step's tensors are smaller), the same for every configuration
MEMORY_FRACTION = 0.8

#: the columns of :func:`gpu_estimate` and :func:`estimate_for_card`, in order
COLUMNS = (
    "gpu",
    "configuration",
    "est_step_ms",
    "est_speedup_vs_O0",
    "bound",
    "est_host_ms",
    "est_gpu_ms",
    "est_compute_ms",
    "est_memory_ms",
    "est_sync_ms",
    "host_syncs_per_step",
    "syncs_known",
)


def step_time(host: float, gpu: float, syncs: float) -> float:
    """One step's time from its host time, GPU time and host syncs (any one unit of time).

    ``t = max(H, G) + s / (s + 1) * min(H, G)``: host and GPU overlap, except that each of the
    ``s`` segments ending in a sync runs its shares ``H/(s+1)`` and ``G/(s+1)`` one after the
    other (the module docstring derives it). ``s`` may be fractional (one read every other
    step: 0.5).

    Args:
        host: the host's dispatch time ``H``.
        gpu: the GPU's kernel time ``G``.
        syncs: host syncs per step ``s >= 0``.

    Example::

        >>> step_time(10.0, 4.0, 0), step_time(10.0, 4.0, 1), step_time(10.0, 4.0, 3)
        (10.0, 12.0, 13.0)
    """
    if syncs < 0:
        raise ValueError(f"syncs={syncs} is negative; a step reads the host 0 or more times.")
    return max(host, gpu) + syncs / (syncs + 1.0) * min(host, gpu)


def card_key(card: str) -> str | None:
    """The :data:`GPU_PEAKS` entry of the GPU named ``card`` as torch reports it, or None.

    Example::

        >>> card_key("NVIDIA H100 80GB HBM3"), card_key("NVIDIA H100 PCIe")
        ('NVIDIA H100 SXM', None)
    """
    return next((key for pattern, key in CARD_NAMES if re.search(pattern, card)), None)


def _num(row, col: str) -> float:
    """``row[col]`` as a float; NaN when the column is missing or holds no number."""
    try:
        return float(row.get(col, math.nan))
    except (TypeError, ValueError):  # None, "", pd.NA
        return math.nan


def _syncs(row) -> tuple[float, bool]:
    """(syncs to estimate with, whether the row counted them): unknown is estimated as 0."""
    s = _num(row, "host_syncs_per_step")
    return (s, True) if math.isfinite(s) and s >= 0 else (0.0, False)


def _bound(host: float, gpu: float, sync: float, compute: float, memory: float) -> str:
    if sync > 0 and sync >= abs(host - gpu):
        return "host syncs"
    if host >= gpu:
        return "host dispatch"
    return "compute" if compute >= memory else "memory"


def _estimate(row, peaks: dict) -> dict:
    """One row's parts and step time on one GPU, in seconds (see the module docstring)."""
    dtype = get_config(row["opt_level"]).gemm_dtype(row["half_dtype"])
    peak = peaks.get(dtype) or peaks["fp32"]  # no tensor cores for it: the fp32 rate
    ops = _num(row, "ops_per_step")
    ops = ops if math.isfinite(ops) else 0.0
    mib = math.fsum(v for v in (_num(row, f"mem_{r}_mib") for r in _ROLES) if math.isfinite(v))
    compute = _num(row, "flops_per_step") / (peak * 1e12 * COMPUTE_FRACTION)
    memory = 2.0 * mib * 2**20 / (peaks["gbps"] * 1e9 * MEMORY_FRACTION)
    floor = ops * KERNEL_FLOOR_US * 1e-6
    host, gpu = ops * HOST_US_PER_OP * 1e-6, max(floor, compute + memory)
    syncs, known = _syncs(row)
    t = step_time(host, gpu, syncs)
    return dict(
        t=t,
        bound=_bound(host, gpu, t - max(host, gpu), compute, memory),
        est_host_ms=host * 1e3,
        est_gpu_ms=gpu * 1e3,
        est_compute_ms=compute * 1e3,
        est_memory_ms=memory * 1e3,
        est_sync_ms=(t - max(host, gpu)) * 1e3,
        host_syncs_per_step=syncs if known else math.nan,
        syncs_known=known,
    )


def _measured(df: pd.DataFrame) -> pd.DataFrame:
    """The rows with the figures the estimate reads: not failed, FLOPs counted."""
    ok = df["status"] != "error" if "status" in df else pd.Series(True, index=df.index)
    return df[ok & df["flops_per_step"].notna()] if "flops_per_step" in df else df.iloc[0:0]


def _card_rows(ok: pd.DataFrame, gpu: str) -> list[dict]:
    peaks, rows = GPU_PEAKS[gpu], []
    if ok.empty:  # also a frame without the columns: nothing measured to estimate from
        return rows
    for _, grp in ok.groupby("batch_size", sort=False):
        base = grp[grp["opt_level"] == BASELINE]
        if base.empty:  # no O0 at this batch size: nothing to compare with
            continue
        t0 = _estimate(base.iloc[0], peaks)["t"]
        for _, r in grp.iterrows():
            e = _estimate(r, peaks)
            t = e.pop("t")
            speedup = t0 / t if t > 0 else math.nan
            rows.append(
                dict(
                    gpu=gpu,
                    configuration=r["configuration"],
                    est_step_ms=t * 1e3,
                    est_speedup_vs_O0=speedup,
                    **e,
                )
            )
    return rows


def gpu_estimate(df: pd.DataFrame) -> pd.DataFrame:
    """Estimated step time and speed vs O0 per GPU of :data:`GPU_PEAKS` and row (not measured).

    ``est_speedup_vs_O0 = t(O0 row of the same batch size) / t(row)``, ``t`` from
    :func:`step_time` with the host time, GPU time and syncs of the module docstring. Failed
    rows, rows without a FLOP count and batch sizes without an O0 row are left out.

    Args:
        df: a :func:`mpnb.lab.compare` DataFrame; reads ``configuration``, ``opt_level``,
            ``half_dtype``, ``batch_size``, ``status``, ``flops_per_step``, ``ops_per_step``,
            ``mem_<role>_mib`` and ``host_syncs_per_step`` (missing: syncs unknown).

    Returns:
        One row per GPU and configuration, columns :data:`COLUMNS`: the step
        (``est_step_ms``, ``est_speedup_vs_O0``, ``bound``), its parts in ms (``est_host_ms``
        ``H``, ``est_gpu_ms`` ``G``, the GPU's ``est_compute_ms`` and ``est_memory_ms``,
        ``est_sync_ms`` = ``t - max(H, G)``), the syncs used (NaN: unknown, estimated as 0)
        and ``syncs_known``.

    Example::

        >>> gpu_estimate(cpu_df).query("gpu == 'NVIDIA A100 SXM 80GB'")["est_speedup_vs_O0"]
    """
    ok = _measured(df)
    rows = [r for gpu in GPU_PEAKS for r in _card_rows(ok, gpu)]
    return pd.DataFrame(rows, columns=list(COLUMNS))


def estimate_for_card(df: pd.DataFrame, card: str) -> pd.DataFrame:
    """:func:`gpu_estimate`'s rows for the GPU named ``card`` as torch reports it
    (``"NVIDIA H100 80GB HBM3"``, matched by :data:`CARD_NAMES`); an empty frame when
    :data:`GPU_PEAKS` has no entry for it (with the columns, so callers can still select them).

    Args:
        df: a :func:`mpnb.lab.compare` DataFrame (see :func:`gpu_estimate`).
        card: ``torch.cuda.get_device_name()`` of the GPU to estimate for.

    Example::

        >>> estimate_for_card(cpu_df, torch.cuda.get_device_name())["est_speedup_vs_O0"]
    """
    key = card_key(card)
    rows = [] if key is None else _card_rows(_measured(df), key)
    return pd.DataFrame(rows, columns=list(COLUMNS))
