"""An ESTIMATE, not a measurement: the measured bytes per step and compute of each distributed
policy scaled to N GPUs on published interconnects, and where communication starts to dominate.

:func:`scale_estimate` reads the rows of ``mpnb.lab.compare(..., ranks=n)`` (one per policy)
and, for each policy, interconnect of :data:`INTERCONNECTS` and number of GPUs N, estimates

* **communication** per step from the bytes each rank sent, by collective op (``bytes_by_op``,
  measured on ``n`` ranks and counted, as the lab counts them, by the ring algorithm's traffic
  per rank): the buffer of each op is recovered from the ring cost on ``n`` ranks and priced
  again on N, with the ring-collective costs of one GPU's link::

      all_reduce                   2 (N-1)/N * buffer / bandwidth + 2 (N-1) * hop latency
      any other op (all_gather,      (N-1)/N * buffer / bandwidth +   (N-1) * hop latency
        reduce_scatter, broadcast, ...)

  plus :data:`BASE_LATENCY_US` per collective call (``calls_by_op`` when the rows have it, one
  call per op and step otherwise: a lower bound on the latency);
* **compute** per step: the row's ``flops_per_step`` (one rank's model FLOPs) on the published
  dense peak of a GPU of :data:`mpnb.lab.verdict.GPU_PEAKS` at ``utilization`` (default
  :data:`UTILIZATION`), in the row's parameter dtype.

No overlap of communication with compute is assumed: a policy is communication-bound at N when
its communication time exceeds its compute time, and ``crossover_gpus`` is the smallest N from
which it is (both times are non-decreasing in N, so the search is exact).

**Weak scaling**: every GPU keeps the rank's batch, so compute per GPU does not change with N.
The buffers do not either: DDP all-reduces the whole gradient; FSDP2's shard per rank shrinks
as 1/N, but each rank still all-gathers every full parameter and reduce-scatters every full
gradient, so its bytes per rank approach the same limit as a ring all-reduce's. (The measured
buffers include FSDP2's padding of each parameter to a multiple of ``n`` rows; the estimate
keeps them as measured, a few rows per parameter at most.)

Example::

    >>> df = mpnb.lab.compare("transformer", ranks=2)
    >>> est = scale_estimate(df)
    >>> print(estimate_text(est))
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import pandas as pd

from mpnb.core.dtype_names import short_name
from mpnb.lab.verdict import GPU_PEAKS

__all__ = [
    "BASE_LATENCY_US",
    "DEFAULT_GPU",
    "INTERCONNECTS",
    "LABEL",
    "UTILIZATION",
    "crossovers",
    "estimate_text",
    "ring_bytes",
    "scale_estimate",
]

#: what every table, attrs and printed line of this module says it is
LABEL = "ESTIMATE, not measured"

#: The published interconnects, per GPU and per direction (what one ring hop can carry).
#: ``max_gpus``: the most GPUs the link joins (None: any number, one NIC per GPU as in a
#: DGX/HGX H100 node's rail-optimised fabric). ``hop_us``: NCCL's own ring/Simple latency per
#: hop for the link class (``hwLat`` in NCCL's ``src/graph/tuning.cc``: NVLink 3.4 us, network
#: 14 us; NCCL models InfiniBand and Ethernet alike).
INTERCONNECTS: dict[str, dict] = {
    "NVLink 4 (H100 SXM, in a node)": dict(
        gbytes_s=450.0,
        hop_us=3.4,
        max_gpus=8,
        source="NVIDIA H100 data sheet: 900 GB/s NVLink per GPU, both directions "
        "(18 links x 50 GB/s); 8 GPUs per HGX H100 board",
    ),
    "InfiniBand NDR 400 Gb/s": dict(
        gbytes_s=50.0,
        hop_us=14.0,
        max_gpus=None,
        source="NVIDIA ConnectX-7 data sheet: NDR 400 Gb/s per port; DGX H100: one port per GPU",
    ),
    "400 GbE": dict(
        gbytes_s=50.0,
        hop_us=14.0,
        max_gpus=None,
        source="IEEE 802.3bs-2017: 400 Gb/s Ethernet; one NIC per GPU assumed",
    ),
    "100 GbE": dict(
        gbytes_s=12.5,
        hop_us=14.0,
        max_gpus=None,
        source="IEEE 802.3ba-2010: 100 Gb/s Ethernet; one NIC per GPU assumed",
    ),
}
#: NCCL's base latency of one ring/Simple collective call (``baseLat`` in ``tuning.cc``), us
BASE_LATENCY_US = 8.4
#: the GPU whose published peaks price the compute (an entry of ``verdict.GPU_PEAKS``)
DEFAULT_GPU = "NVIDIA H100 SXM"
#: the fraction of the peak a training step reaches (model FLOPs utilisation): Llama 3's
#: 405B pre-training reported 38-43% on H100s (Dubey et al., "The Llama 3 Herd of Models", 2024)
UTILIZATION = 0.4
#: the largest N the crossover search looks at (beyond: "not within" this many GPUs)
MAX_GPUS = 1 << 20

# ring cost of an op, as multiples of its buffer: bytes one GPU sends, and latency hops; an
# all-reduce is a reduce-scatter then an all-gather, every other op one pass round the ring
# (a broadcast's bytes are the mean over ranks, as the lab's counter counts them)
_RING = {"all_reduce": (lambda n: 2.0 * (n - 1) / n, lambda n: 2 * (n - 1))}
_ONE_PASS = (lambda n: (n - 1) / n, lambda n: n - 1)


def ring_bytes(op: str, buffer_bytes: float, n: int) -> float:
    """The bytes one GPU sends for one ring ``op`` over ``buffer_bytes`` on ``n`` GPUs
    (``2 (n-1)/n`` of the buffer for an all-reduce, ``(n-1)/n`` for every other op).

    Example::

        >>> ring_bytes("all_reduce", 1000, 4)  # 2 (4-1)/4 * 1000
        1500.0
    """
    return _RING.get(op, _ONE_PASS)[0](n) * float(buffer_bytes)


def _rows(df_or_rows) -> list[dict]:
    if isinstance(df_or_rows, pd.DataFrame):
        rows = df_or_rows.to_dict("records")
    else:
        rows = [dict(r) for r in df_or_rows]
    need = ("policy", "ranks", "bytes_by_op", "flops_per_step")
    ok = []
    for r in rows:
        missing = [k for k in need if k not in r]
        if missing:
            raise ValueError(
                f"row {r.get('policy', r)!r} lacks {missing}: pass the DataFrame of "
                "mpnb.lab.compare(..., ranks=N) (or rows with its distributed columns)."
            )
        if r.get("status", "ok") != "ok" or not isinstance(r["bytes_by_op"], Mapping):
            continue  # a failed, hung or skipped policy has no whole step to scale
        ok.append(r)
    return ok


def _peak_tflops(gpu: str, dtype) -> float:
    peaks = GPU_PEAKS[gpu]
    return peaks.get(short_name(str(dtype).replace("torch.", ""))) or peaks["fp32"]


def _comm_s(buffers: dict, calls: Mapping, n: int, link: dict) -> tuple[float, float]:
    """(bytes one GPU sends, seconds) per step for ``buffers`` (op -> bytes) on ``n`` GPUs."""
    sent = seconds = 0.0
    for op, buf in buffers.items():
        b = ring_bytes(op, buf, n)
        hops = _RING.get(op, _ONE_PASS)[1](n)
        k = float(calls.get(op, 1)) if n > 1 else 0.0
        sent += b
        latency = k * (BASE_LATENCY_US + hops * link["hop_us"]) * 1e-6
        seconds += b / (link["gbytes_s"] * 1e9) + latency
    return sent, seconds


def _crossover(buffers, calls, compute_s, link) -> int | None:
    """The smallest N >= 2 with comm(N) > compute (comm is non-decreasing in N), or None
    (also when the row counted no FLOPs: there is nothing to compare with)."""
    if not (math.isfinite(compute_s) and compute_s > 0):
        return None
    top = min(link["max_gpus"] or MAX_GPUS, MAX_GPUS)
    if top < 2 or _comm_s(buffers, calls, top, link)[1] <= compute_s:
        return None
    lo, hi = 2, top
    while lo < hi:
        mid = (lo + hi) // 2
        if _comm_s(buffers, calls, mid, link)[1] > compute_s:
            hi = mid
        else:
            lo = mid + 1
    return lo


def scale_estimate(
    df_or_rows,
    gpus: Iterable[int] = (8, 64, 512, 4096),
    interconnects: Mapping[str, dict] | Iterable[str] | None = None,
    *,
    gpu: str = DEFAULT_GPU,
    utilization: float = UTILIZATION,
) -> pd.DataFrame:
    """ESTIMATE (not measured) of each policy's communication and compute time per step on N
    GPUs, and the N from which communication exceeds compute (no overlap assumed).

    Args:
        df_or_rows: the DataFrame of ``mpnb.lab.compare(..., ranks=n)`` or its rows (dicts with
            ``policy``, ``ranks``, ``bytes_by_op``, ``flops_per_step``; ``strategy``,
            ``param_dtype``, ``reduce_dtype``, ``calls_by_op`` when present). Only rows whose
            ``status`` is ``"ok"`` are scaled.
        gpus: the numbers of GPUs to tabulate.
        interconnects: names of :data:`INTERCONNECTS`, or a mapping of your own (the same
            fields); None: all of them. N above a link's ``max_gpus`` is left out.
        gpu: the :data:`mpnb.lab.verdict.GPU_PEAKS` entry that prices the compute.
        utilization: the fraction of that GPU's peak a step reaches (0 < u <= 1).

    Returns:
        One row per policy x interconnect x N: ``policy``, ``strategy``, ``reduce_dtype``,
        ``interconnect``, ``gpus``, ``comm_bytes_per_gpu``, ``comm_ms``, ``compute_ms``,
        ``comm_over_compute``, ``comm_dominates``, ``crossover_gpus`` (pandas ``Int64``; NA:
        not within the link's reach). ``attrs["label"]`` says it is an estimate;
        ``attrs["assumptions"]`` holds the figures it used.

    Example::

        >>> scale_estimate(df, gpus=(8, 64), interconnects=["InfiniBand NDR 400 Gb/s"])
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization {utilization}: give a fraction of the peak in (0, 1].")
    if gpu not in GPU_PEAKS:
        raise ValueError(f"gpu {gpu!r} is not in verdict.GPU_PEAKS: use one of {list(GPU_PEAKS)}.")
    links = _links(interconnects)
    out = []
    for r in _rows(df_or_rows):
        n = int(r["ranks"])
        buffers = {op: b / _ring_factor(op, n) for op, b in r["bytes_by_op"].items() if b}
        calls = r.get("calls_by_op") if isinstance(r.get("calls_by_op"), Mapping) else {}
        dtype = r.get("param_dtype") or "float32"
        compute_s = float(r["flops_per_step"]) / (_peak_tflops(gpu, dtype) * 1e12 * utilization)
        for name, link in links.items():
            cross = _crossover(buffers, calls, compute_s, link)
            for g in gpus:
                if link["max_gpus"] and g > link["max_gpus"]:
                    continue
                sent, comm = _comm_s(buffers, calls, int(g), link)
                out.append(
                    dict(
                        policy=r["policy"],
                        strategy=r.get("strategy", ""),
                        reduce_dtype=r.get("reduce_dtype", ""),
                        interconnect=name,
                        gpus=int(g),
                        comm_bytes_per_gpu=sent,
                        comm_ms=comm * 1e3,
                        compute_ms=compute_s * 1e3,
                        comm_over_compute=comm / compute_s if compute_s > 0 else math.nan,
                        comm_dominates=bool(comm > compute_s > 0),
                        crossover_gpus=cross,
                    )
                )
    est = pd.DataFrame(out, columns=_COLUMNS)
    est["crossover_gpus"] = est["crossover_gpus"].astype("Int64")
    est.attrs["label"] = (
        f"{LABEL}: measured bytes per step and FLOPs scaled to N GPUs with ring-collective "
        f"costs; compute on a {gpu} at {utilization:.0%} of its published peak; weak scaling "
        "(each GPU keeps the rank's batch); no overlap of communication with compute."
    )
    est.attrs["assumptions"] = dict(
        gpu=gpu,
        peaks_tflops=dict(GPU_PEAKS[gpu]),
        utilization=utilization,
        interconnects={k: dict(v) for k, v in links.items()},
        base_latency_us=BASE_LATENCY_US,
        overlap=False,
        scaling="weak",
    )
    return est


_COLUMNS = [
    "policy",
    "strategy",
    "reduce_dtype",
    "interconnect",
    "gpus",
    "comm_bytes_per_gpu",
    "comm_ms",
    "compute_ms",
    "comm_over_compute",
    "comm_dominates",
    "crossover_gpus",
]


def _ring_factor(op: str, n: int) -> float:
    f = ring_bytes(op, 1.0, n)
    if f <= 0:
        raise ValueError(
            f"{op} bytes measured on {n} rank(s): one rank sends nothing, so its buffer cannot "
            "be recovered; measure with ranks >= 2."
        )
    return f


def _links(interconnects) -> dict[str, dict]:
    if interconnects is None:
        return dict(INTERCONNECTS)
    if isinstance(interconnects, Mapping):
        return dict(interconnects)
    unknown = [k for k in interconnects if k not in INTERCONNECTS]
    if unknown:
        raise ValueError(
            f"interconnects {unknown} are not in INTERCONNECTS: use {list(INTERCONNECTS)} or "
            "pass a mapping name -> dict(gbytes_s=, hop_us=, max_gpus=)."
        )
    return {k: INTERCONNECTS[k] for k in interconnects}


def crossovers(est: pd.DataFrame) -> pd.DataFrame:
    """Policy x interconnect: the N of GPUs from which communication exceeds compute
    (ESTIMATE; NA: not within the link's reach). Keeps ``attrs["label"]``."""
    table = est.pivot_table(
        index="policy", columns="interconnect", values="crossover_gpus", aggfunc="first", sort=False
    )
    table.attrs["label"] = est.attrs.get("label", LABEL)
    return table


def estimate_text(est: pd.DataFrame) -> str:
    """The estimate in words, headed by its label: per policy, the number of GPUs from which
    communication exceeds compute on each interconnect."""
    lines = [est.attrs.get("label", LABEL)]
    for policy, grp in est.groupby("policy", sort=False):
        parts = []
        for link, g in grp.groupby("interconnect", sort=False):
            cross = g["crossover_gpus"].iloc[0]
            parts.append(f"{link} {'-' if pd.isna(cross) else int(cross)}")
        lines.append(f"  {policy}: communication exceeds compute from N GPUs = {', '.join(parts)}")
    lines.append("  (-: compute stays larger within the link's reach)")
    return "\n".join(lines)
