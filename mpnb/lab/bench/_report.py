"""What a benchmark run prints and saves: the header (the conditions) and the table (rows)."""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Sequence

import torch

from mpnb.lab._files import write_atomic
from mpnb.lab.bench._harness import Row, l2_bytes
from mpnb.lab.stats import loadavg

__all__ = [
    "ALLOCATOR_ENV",
    "COLUMN_TITLES",
    "collect_header",
    "format_header",
    "format_rows",
    "loadavg",
    "write_json",
]

#: Environment variables that change how outputs are allocated (and so what a kernel costs).
ALLOCATOR_ENV = (
    "MALLOC_MMAP_MAX_",
    "MALLOC_TRIM_THRESHOLD_",
    "MPNB_CPU_OUTPUT_CACHE_MB",
    "THP_MEM_ALLOC_ENABLE",
    "PYTORCH_CUDA_ALLOC_CONF",
)


def _kernel_paths(device: str) -> str:
    # Imported here: building the kernels is the caller's choice (ensure_kernels() builds them).
    from mpnb.core.ops import all_ops, op_path

    paths = {op.name: op_path(op.name, device) for op in all_ops()}
    kinds = set(paths.values())
    if len(kinds) == 1:
        return f"{kinds.pop()} for all {len(paths)} ops"
    return "; ".join(f"{k}: {v}" for k, v in paths.items())


def collect_header(device: str = "cpu", build: bool = True) -> dict:
    """The conditions of a run: versions, threads, CPU, allocator, kernels, load, date.

    Args:
        device: the device the suite runs on (its kernel path is reported).
        build: build/load mpnb's kernels first, so that the header says what really runs
            and the build is never inside a timing.
    """
    from mpnb.core.hardware import cpu_info
    from mpnb.core.ops import ensure_kernels

    if build:
        ensure_kernels()
    cpu = cpu_info()
    header = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu": cpu.model,
        "isa": cpu.isa,
        "cpu_count": os.cpu_count(),
        "l2_per_core": l2_bytes(),  # sizes the in-cache slices of the roofline
        "allocator": {k: os.environ.get(k, "unset") for k in ALLOCATOR_ENV},
        "mpnb_kernels": _kernel_paths(device),
        "device": device,
        "loadavg_start": loadavg(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        header["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return header


def format_header(header: dict) -> str:
    """The header as ``key: value`` lines."""
    lines = []
    for k, v in header.items():
        if isinstance(v, dict):
            v = " ".join(f"{a}={b}" for a, b in v.items())
        lines.append(f"# {k}: {v}")
    return "\n".join(lines)


def _fmt_time(s: float) -> str:
    if s != s:  # nan
        return "-"
    for unit, f in (("s", 1.0), ("ms", 1e3), ("us", 1e6)):
        if s * f >= 1.0:
            return f"{s * f:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


def _fmt_ratio(row: Row) -> str:
    if row.status == "SKIPPED":
        return ""
    if row.role == "baseline":
        return "1 (base)"
    if row.ratio is None:
        return ""
    if row.extra_target_s is not None and row.extra_s is not None:
        return f"+{row.extra_s * 1e6:.1f}us (<={row.extra_target_s * 1e6:g})"
    if row.extra_ratio is not None:
        text = f"+{row.extra_s * 1e6:.0f}us={row.extra_ratio:.2f}x"
        if row.extra_ratio_target is not None:
            text += f" (<={row.extra_ratio_target:g})"
        return text
    text = f"{row.ratio:.2f}x"
    return f"{text} (>={row.target:g})" if row.target is not None else text


def _fmt_bw(row: Row) -> str:
    if row.bw_frac is None:
        return ""
    text = f"{100 * row.bw_frac:.0f}%"
    if row.bw_target is not None:
        text += f" (>={100 * row.bw_target:.0f})"
    return text


def _fmt_roofline(row: Row) -> str:
    if row.cache_gbps is None:
        return ""
    text = f"in-cache {row.cache_gbps:.3g} GB/s"
    if row.cache_frac is not None:
        text += f" = {100 * row.cache_frac:.0f}%"
    return f"{row.bound}-bound: {text}" if row.bound else text


def _fmt_compile(row: Row) -> str:
    if row.compile_s is None:
        return ""
    text = _fmt_time(row.compile_s)
    if row.compile_calls > 1:
        text += f" x{row.compile_calls}"
    return f"{text} {row.compile_cache}".rstrip()


_COLUMNS = (  # title, width, cell
    ("case", 37, lambda r: f"{r.case} [{r.workload}]"),
    ("candidate", 38, lambda r: r.candidate),
    ("median", 9, lambda r: _fmt_time(r.median_s)),
    ("spread", 7, lambda r: f"{100 * r.iqr_s / r.median_s:.0f}%" if r.median_s > 0 else ""),
    ("vs PyTorch", 17, _fmt_ratio),
    ("GB/s", 6, lambda r: f"{r.gbps:.1f}" if r.gbps is not None else ""),
    ("% bw", 11, _fmt_bw),
    ("roofline", 38, _fmt_roofline),
    ("status", 6, lambda r: r.status),
    ("preempt", 7, lambda r: f"{r.preempt_per_call:.2g}"),
    ("compile", 16, _fmt_compile),
)


def _fmt_interval(row: Row) -> str:
    return f"{row.ratio_lo:.2f}-{row.ratio_hi:.2f}" if row.ratio_lo is not None else ""


#: Columns a suite may name in its ``COLUMNS`` besides the default ones above.
_MORE_COLUMNS = (
    ("95% CI", 11, _fmt_interval),
    ("rounds", 6, lambda r: str(r.rounds) if r.rounds else ""),
    ("TFLOP/s", 8, lambda r: f"{r.tflops:.3g}" if r.tflops is not None else ""),
    ("note", 22, lambda r: r.note),
)
_CATALOG = {c[0]: c for c in (*_COLUMNS, *_MORE_COLUMNS)}
#: The titles of every column a suite's ``COLUMNS`` may name, in no particular order.
COLUMN_TITLES = tuple(_CATALOG)


def _columns(titles: Sequence[str] | None) -> tuple:
    if titles is None:
        return _COLUMNS
    unknown = [t for t in titles if t not in _CATALOG]
    if unknown:
        raise ValueError(
            f"unknown table column(s) {', '.join(map(repr, unknown))}; a suite's COLUMNS "
            f"names some of: {', '.join(COLUMN_TITLES)}."
        )
    return tuple(_CATALOG[t] for t in titles)


def format_rows(
    rows: Sequence[Row], title: bool = True, columns: Sequence[str] | None = None
) -> str:
    """The rows as a fixed-width table (``spread`` is the IQR as a % of the median).

    ``columns`` names the columns to show, by title (a suite's ``COLUMNS``; None: the default
    set below). Beyond those, ``95% CI`` is the 95% interval of a candidate's ratio,
    ``rounds`` the rounds its case ran,
    ``TFLOP/s`` its achieved rate (candidates that declare ``flops``) and ``note`` how it runs.

    ``preempt`` is the OS's involuntary context switches of the process per call: near 0 on a
    quiet machine; above ~0.5 the timings include waits for a preempted thread.

    ``roofline`` is, for a candidate timed also on cache-resident slices, its in-cache
    throughput in GB/s of the same bytes and its share of the same-run bandwidth baseline's
    GB/s: ``compute-bound`` below the harness's ``COMPUTE_BOUND`` share (the kernel's arithmetic
    cannot keep up with memory here), ``memory-bound`` above.

    ``compile`` is a ``torch.compile`` candidate's compile time (the calls until its graph was
    warm; ``xN``: N calls compiled; ``cached``: inductor's on-disk cache held every graph),
    apart from its steady-state ``median``. A row whose status is ``ERROR`` is followed by its
    reason.

    ``title=False`` leaves out the column titles, so a run can print case after case.
    """
    cols = _columns(columns)
    lines = []
    if title:
        lines.append("  ".join(t.ljust(w) for t, w, _ in cols).rstrip())
        lines.append("  ".join("-" * w for _, w, _ in cols))
    for r in rows:
        lines.append("  ".join(str(cell(r)).ljust(w) for _, w, cell in cols).rstrip())
        if r.error:
            lines.append(f"    {r.candidate}: {r.error}")
    return "\n".join(lines)


def write_json(
    path: str | os.PathLike, header: dict, rows: Sequence[Row], summary: Sequence[str] = ()
) -> None:
    """Save ``{"header": ..., "rows": [row dicts]}`` to ``path``, plus ``"summary"`` (the
    suite's closing sentences) when there is one (whole, or the previous file stays: see
    :func:`mpnb.lab._files.write_atomic`)."""
    data = {"header": header, "rows": [r.to_dict() for r in rows]}
    if summary:
        data["summary"] = list(summary)
    write_atomic(path, json.dumps(data, indent=1) + "\n")
