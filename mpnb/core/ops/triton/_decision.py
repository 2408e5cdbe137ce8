"""Which Triton kernels serve CUDA calls by default: decided by a committed table of ratios
measured on a GPU (``measured.json`` beside this file), never assumed.

A kernel measured at least as fast as PyTorch's own CUDA path on every case of
``mpnb bench --device cuda`` is on by default; a slower one stays opt-in and ``mpnb doctor``
shows its ratio; an unmeasured one stays opt-in. ``scripts/gpu-check.sh`` writes the table
from its bench run (:func:`record`); nothing else does.

One bench run is not enough near 1.0: the same kernel source has measured 0.64x and then
1.04x PyTorch's speed on one H100 model (its autotuned configuration differs between runs).
So each run is pooled with the earlier runs of the same card, torch and kernel source
(:func:`kernel_source`): a case keeps its worst ratio over them, and a kernel is a default
only while it has held PyTorch's speed in every run. A change to a kernel's source starts its
record afresh.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "TABLE",
    "TritonDecision",
    "decide",
    "kernel_source",
    "load_table",
    "record",
    "write_table",
]

#: the committed table: ``{"kernels": {op: {"speed_vs_torch": ..., "cases": {...}, ...}}}``
TABLE = Path(__file__).with_name("measured.json")
#: a kernel is on by default at or above this ratio (PyTorch's time / the kernel's)
DEFAULT_AT = 1.0


@dataclass(frozen=True)
class TritonDecision:
    """Whether op ``name``'s Triton kernel is on by default, and the measurement behind it.

    Attributes:
        name: the ``mpnb::`` op.
        default: measured at least as fast as PyTorch's CUDA path (on by default).
        speed_vs_torch: PyTorch's time over the kernel's, the worst of its bench cases
            (above 1: faster), or None when it was never measured on a GPU.
        measured_on: the card and date of the measurement ("" when unmeasured).
    """

    name: str
    default: bool
    speed_vs_torch: float | None
    measured_on: str

    @property
    def label(self) -> str:
        """``"default: 1.31x PyTorch's speed (NVIDIA H100 80GB HBM3, 2026-05-01)"``, or
        ``"opt-in (MPNB_TRITON=1): 0.80x ..."``, or ``"opt-in (MPNB_TRITON=1), unmeasured on
        a GPU"``."""
        if self.speed_vs_torch is None:
            return "opt-in (MPNB_TRITON=1), unmeasured on a GPU"
        speed = f"{self.speed_vs_torch:.2f}x PyTorch's speed ({self.measured_on})"
        return f"default: {speed}" if self.default else f"opt-in (MPNB_TRITON=1): {speed}"


def load_table(path: str | Path | None = None) -> dict:
    """The measured table (``{"kernels": {}}`` when the file is absent)."""
    p = Path(path) if path is not None else TABLE
    if not p.is_file():
        return {"kernels": {}}
    table = json.loads(p.read_text())
    if not isinstance(table, dict) or not isinstance(table.get("kernels"), dict):
        raise ValueError(
            f"{p} is not a table of measured Triton kernels ({{'kernels': {{...}}}}); "
            "restore it with `git checkout` or rerun scripts/gpu-check.sh."
        )
    return table


def decide(name: str, table: Mapping) -> TritonDecision:
    """The decision for op ``name`` from ``table`` (see :func:`load_table`).

    Example::

        >>> decide("rope", {"kernels": {"rope": {"speed_vs_torch": 1.4, "card": "H100",
        ...                                      "date": "2026-05-01"}}}).default
        True
    """
    entry = table.get("kernels", {}).get(name)
    if not entry or entry.get("speed_vs_torch") is None:
        return TritonDecision(name, False, None, "")
    ratio = float(entry["speed_vs_torch"])
    where = ", ".join(str(entry[k]) for k in ("card", "date") if entry.get(k))
    return TritonDecision(name, ratio >= DEFAULT_AT, ratio, where)


def kernel_source(module: str) -> str:
    """A digest of the source a Triton kernel runs: its module in this package (``"adam"``) and
    the package's shared helpers (``_*.py``, this file aside), so that measurements are pooled
    only across runs of the same code (:func:`record`)."""
    here = Path(__file__).parent
    helpers = sorted(p for p in here.glob("_*.py") if p.name != Path(__file__).name)
    digest = hashlib.sha256()
    for path in [here / f"{module}.py", *helpers]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def record(
    rows: Iterable[Mapping],
    card: str,
    date: str,
    *,
    previous: Mapping | None = None,
    sources: Mapping[str, str] | None = None,
    **about: str,
) -> dict:
    """A table from ``mpnb bench --device cuda --json`` rows: per kernel, the worst ratio of
    its cases (a kernel must be at least PyTorch's speed on every case to be a default),
    pooled with ``previous`` where that run measured the same code the same way.

    Args:
        rows: the bench's rows; a kernel's rows are the candidates named ``"triton <op>"``.
        card: the GPU's name. date: ``YYYY-MM-DD``.
        previous: the table so far (:func:`load_table`). An entry of the same card, the same
            ``about`` values (torch, triton...) and the same ``sources`` digest is pooled: each
            case keeps its worst ratio and ``runs`` counts the runs. Any other entry of an op
            this run measured is replaced; one of an op it did not measure is kept when its
            digest still matches ``sources``, else dropped.
        sources: op -> :func:`kernel_source` of the code measured (without it, nothing pools).
        about: more to keep, and to match on when pooling (torch, triton...).

    Example::

        >>> record(rows, "NVIDIA H100 80GB HBM3", "2026-11-27", previous=load_table(),
        ...        sources={op: kernel_source("adam") for op in ("fused_adam_",)},
        ...        torch="2.11.0")["kernels"]["fused_adam_"]["runs"]
        2
    """
    sources = dict(sources or {})
    cases: dict[str, dict[str, float]] = {}
    for r in rows:
        name = str(r.get("candidate", ""))
        if r.get("role") != "candidate" or not name.startswith("triton ") or r.get("ratio") is None:
            continue
        op = name.split()[1]
        cases.setdefault(op, {})[f"{r['case']} [{r['workload']}]"] = round(float(r["ratio"]), 3)
    before = dict((previous or {}).get("kernels", {}))

    def same_code(op: str, entry: Mapping) -> bool:
        return op in sources and entry.get("kernel_source") == sources[op]

    kernels = {}
    for op, c in cases.items():
        entry = dict(card=card, date=date, runs=1, **about)
        if op in sources:
            entry["kernel_source"] = sources[op]
        prev = before.get(op, {})
        pooled = (
            same_code(op, prev)
            and prev.get("card") == card
            and all(prev.get(k) == v for k, v in about.items())
        )
        if pooled:
            old = prev.get("cases", {})
            c = {k: min(v for v in (c.get(k), old.get(k)) if v is not None) for k in {*old, *c}}
            entry["runs"] = int(prev.get("runs", 1)) + 1
            entry["first_date"] = prev.get("first_date", prev.get("date", date))
        kernels[op] = dict(entry, cases=dict(sorted(c.items())), speed_vs_torch=min(c.values()))
    for op, prev in before.items():  # measured before, not in this run: kept while still true
        if op not in kernels and same_code(op, prev):
            kernels[op] = dict(prev)
    return {"kernels": dict(sorted(kernels.items()))}


def write_table(table: Mapping, path: str | Path | None = None) -> Path:
    """Write ``table`` (as :func:`record` builds it) to the committed file, or to ``path``."""
    p = Path(path) if path is not None else TABLE
    p.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return p
