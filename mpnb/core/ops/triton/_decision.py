"""Which Triton kernels serve CUDA calls by default: decided by a committed table of ratios
measured on a GPU (``measured.json`` beside this file), never assumed.

A kernel is on by default only where it measured at least as fast as PyTorch's own CUDA path
on every case of ``mpnb bench --device cuda``, **the lower end of each case's 95% interval
included**; a slower one, or one whose ratio has no interval (a ``--quick`` run of an earlier
version measured each case once), stays opt-in and ``mpnb doctor`` shows its ratio and
interval; an unmeasured one stays opt-in. ``scripts/gpu-check.sh`` writes the table from its
bench run (:func:`record`); nothing else does.

One bench run is not enough near 1.0: the same kernel source has measured 0.64x and then
1.04x PyTorch's speed on one H100 model (its autotuned configuration differs between runs).
So each run is pooled with the earlier runs of the same card, torch, triton and kernel source
(:func:`kernel_source`): a case keeps its worst run (the lowest lower end), and a kernel is a
default only while every run held PyTorch's speed. A change to a kernel's source starts its
record afresh, and until then its old record is shown as of other code and is no default
(:func:`decide` compares the record's ``kernel_source`` with today's).

An entry: ``card``, ``date``, ``first_date``, ``runs``, ``source`` (the command), ``torch``,
``triton``, ``kernel_source``, ``cases`` (``{"<case> [<workload>]": {"ratio", "lo", "hi",
"bw_frac"}}``: the median ratio, its 95% interval and the share of the same-run copy
bandwidth), and the worst case's ``speed_vs_torch``, ``speed_lo`` and ``speed_hi``.
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

#: the committed table: ``{"kernels": {op: {"speed_vs_torch": ..., "speed_lo": ..., "cases":
#: {...}, ...}}}`` (the module docstring lists an entry's keys)
TABLE = Path(__file__).with_name("measured.json")
#: a kernel is on by default where the lower end of every case's 95% interval of its ratio
#: (PyTorch's time / the kernel's) is at or above this
DEFAULT_AT = 1.0


@dataclass(frozen=True)
class TritonDecision:
    """Whether op ``name``'s Triton kernel is on by default, and the measurement behind it.

    Attributes:
        name: the ``mpnb::`` op.
        default: the lower end of every case's 95% interval at least 1.0 (on by default).
        speed_vs_torch: PyTorch's time over the kernel's in its worst bench case (the case
            with the lowest lower end; above 1: faster), or None when it was never measured on
            a GPU.
        measured_on: the card and date of the measurement ("" when unmeasured).
        speed_lo, speed_hi: that case's 95% interval, or None (a ratio measured without one).
        stale: the measurement is of other kernel code than today's (its ``kernel_source``
            differs): shown, never a default.
    """

    name: str
    default: bool
    speed_vs_torch: float | None
    measured_on: str
    speed_lo: float | None = None
    speed_hi: float | None = None
    stale: bool = False

    @property
    def label(self) -> str:
        """``"default: 1.31x PyTorch's speed, 95% 1.25-1.37 (NVIDIA H100 80GB HBM3,
        2026-05-01)"``, or ``"opt-in (MPNB_TRITON=1): 0.98x ..., 95% 0.95-1.02 (...)"``, or
        ``"opt-in (MPNB_TRITON=1): 1.15x PyTorch's speed, no 95% interval (...)"``, or
        ``"opt-in (MPNB_TRITON=1), unmeasured on a GPU"``."""
        if self.speed_vs_torch is None:
            return "opt-in (MPNB_TRITON=1), unmeasured on a GPU"
        interval = (
            f"95% {self.speed_lo:.2f}-{self.speed_hi:.2f}"
            if self.speed_lo is not None and self.speed_hi is not None
            else "no 95% interval (one --quick measurement: rerun scripts/gpu-check.sh)"
        )
        speed = f"{self.speed_vs_torch:.2f}x PyTorch's speed, {interval} ({self.measured_on})"
        if self.stale:
            speed += ", measured on other code than this kernel's"
            if "rerun" not in interval:
                speed += " (rerun scripts/gpu-check.sh)"
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


def decide(name: str, table: Mapping, source: str | None = None) -> TritonDecision:
    """The decision for op ``name`` from ``table`` (see :func:`load_table`); with ``source``
    (today's :func:`kernel_source` of its module), an entry recorded for other code is stale:
    shown, never a default (a changed kernel is measured afresh before it serves a call).

    Example::

        >>> decide("rope", {"kernels": {"rope": {"speed_vs_torch": 1.4, "speed_lo": 1.3,
        ...   "speed_hi": 1.5, "card": "H100", "date": "2026-05-01"}}}).default
        True
    """
    entry = table.get("kernels", {}).get(name)
    if not entry or entry.get("speed_vs_torch") is None:
        return TritonDecision(name, False, None, "")
    ratio = float(entry["speed_vs_torch"])
    lo, hi = (None if entry.get(k) is None else float(entry[k]) for k in ("speed_lo", "speed_hi"))
    where = ", ".join(str(entry[k]) for k in ("card", "date") if entry.get(k))
    recorded = entry.get("kernel_source")
    stale = source is not None and recorded is not None and recorded != source
    default = not stale and lo is not None and lo >= DEFAULT_AT
    return TritonDecision(name, default, ratio, where, lo, hi, stale)


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


def _case(r: Mapping) -> dict:
    """A bench row's measurement of one case: ratio, interval, share of the copy bandwidth."""
    out = dict(ratio=round(float(r["ratio"]), 3), lo=round(float(r["ratio_lo"]), 3))
    out["hi"] = round(float(r["ratio_hi"]), 3)
    if r.get("bw_frac") is not None:
        out["bw_frac"] = round(float(r["bw_frac"]), 3)
    return out


def _worse(a: dict | None, b: dict | None) -> dict:
    """Of two measurements of a case, the one with the lower lower end."""
    return min((x for x in (a, b) if x is not None), key=lambda x: x["lo"])


def record(
    rows: Iterable[Mapping],
    card: str,
    date: str,
    *,
    previous: Mapping | None = None,
    sources: Mapping[str, str] | None = None,
    **about: str,
) -> dict:
    """A table from ``mpnb bench --device cuda --json`` rows: per kernel, every case's ratio
    with its 95% interval and share of the copy bandwidth, and the worst case (the lowest
    lower end: a kernel must hold PyTorch's speed on every case, interval included, to be a
    default), pooled with ``previous`` where that run measured the same code the same way.

    Args:
        rows: the bench's rows; a kernel's rows are the candidates named ``"triton <op>"``.
            A row without an interval (``ratio_lo`` None: fewer than 3 rounds) or without a
            ratio (a skipped case) is no measurement and is left out.
        card: the GPU's name. date: ``YYYY-MM-DD``.
        previous: the table so far (:func:`load_table`). An entry of the same card, the same
            ``about`` values (torch, triton...) and the same ``sources`` digest is pooled: each
            case keeps its worse run (:func:`_worse`) and ``runs`` counts the runs. Any other
            entry of an op this run measured is replaced; one of an op it did not measure is
            kept when its digest still matches ``sources``, else dropped.
        sources: op -> :func:`kernel_source` of the code measured (without it, nothing pools).
        about: more to keep, and to match on when pooling (torch, triton...).

    Example::

        >>> record(rows, "NVIDIA H100 80GB HBM3", "2026-11-27", previous=load_table(),
        ...        sources={op: kernel_source("adam") for op in ("fused_adam_",)},
        ...        torch="2.11.0")["kernels"]["fused_adam_"]["runs"]
        2
    """
    sources = dict(sources or {})
    cases: dict[str, dict[str, dict]] = {}
    for r in rows:
        name = str(r.get("candidate", ""))
        if r.get("role") != "candidate" or not name.startswith("triton "):
            continue
        if r.get("ratio") is None or r.get("ratio_lo") is None or r.get("ratio_hi") is None:
            continue
        op = name.split()[1]
        cases.setdefault(op, {})[f"{r['case']} [{r['workload']}]"] = _case(r)
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
            and all(isinstance(v, dict) for v in prev.get("cases", {}).values())
        )
        if pooled:
            old = prev.get("cases", {})
            c = {k: _worse(c.get(k), old.get(k)) for k in {*old, *c}}
            entry["runs"] = int(prev.get("runs", 1)) + 1
            entry["first_date"] = prev.get("first_date", prev.get("date", date))
        worst = min(c.values(), key=lambda x: x["lo"])
        kernels[op] = dict(
            entry,
            cases=dict(sorted(c.items())),
            speed_vs_torch=worst["ratio"],
            speed_lo=worst["lo"],
            speed_hi=worst["hi"],
        )
    for op, prev in before.items():  # measured before, not in this run: kept while still true
        if op not in kernels and same_code(op, prev):
            kernels[op] = dict(prev)
    return {"kernels": dict(sorted(kernels.items()))}


def write_table(table: Mapping, path: str | Path | None = None) -> Path:
    """Write ``table`` (as :func:`record` builds it) to the committed file, or to ``path``."""
    p = Path(path) if path is not None else TABLE
    p.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return p
