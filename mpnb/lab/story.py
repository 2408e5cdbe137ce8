"""The lessons' hardware sentences, computed from doctor's facts and the measured numbers.

Every sentence a notebook or the verdict prints about the hardware comes from here, so that it
holds on any machine. Two inputs decide it, and nothing here measures or assumes either:

* **doctor's facts**: per low-precision dtype, ``"native"``, ``"emulated"`` or
  ``"unsupported"`` in this process (:func:`facts`, which is
  :func:`mpnb.core.hardware.dtype_support`: a timed GEMM probe with ATen's capability and
  oneDNN's ISA limit as evidence);
* **the measured numbers**: a speed ratio against an fp32 baseline (the baseline's time over
  the subject's, so above 1 is faster), with its 95% interval when there is one (a
  :func:`mpnb.lab.compare` row's ``speedup_vs_O0``, ``speedup_lo``, ``speedup_hi``).

The direction (faster, slower, no measurable difference) is always the numbers'. The fact
picks the explanation; an outcome the fact does not lead one to expect is called unexpected
and explained, never hidden.

Every function that takes ``facts`` accepts :func:`facts`'s ``DtypeSupport`` values, plain
status strings keyed the same way (:func:`~mpnb.core.hardware.half_support`'s
``{"bfloat16": "native"}``), or a compare DataFrame's ``attrs["hardware"]``
(``{"bf16": "native", "fp16": ..., "fp8": ...}``), and any name of a dtype: the names are
:mod:`mpnb.core.dtype_names`'.

Example::

    >>> from mpnb.lab import story
    >>> f = story.facts("cpu")
    >>> print(story.hardware(f, dtypes=["bf16"]))
    On this CPU bf16 is native: it can save time as well as memory. (doctor: 2.8x fp32's ...)
    >>> print(story.outcome(f, "bf16", 0.31, 0.28, 0.35, subject="O3"))
    Measured: O3 ran 3.23x slower than O0 (95% interval 2.86x-3.57x). bf16 is native ...
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import pandas as pd

from mpnb.core.dtype_names import HALF_NAMES, lookup, short_name
from mpnb.core.hardware import dtype_support, status_of
from mpnb.core.number_formats import NumberFormat, format_of
from mpnb.core.precision_configs import config_names, get_config

__all__ = [
    "facts",
    "status",
    "hardware",
    "direction",
    "speed",
    "outcome",
    "compare",
    "fixed_cost",
    "emulated_clause",
    "row_note",
    "run_note",
    "emulation_lines",
]


def _format(short: str) -> NumberFormat:
    """The table's row for ``short`` (a name it lacks reads as a plain half format)."""
    return format_of(short) or NumberFormat(short, short)


def _emulation(short: str) -> tuple[str, str]:
    """What emulation does to every op of ``short``, and what that leaves to read."""
    fmt = _format(short)
    return fmt.cost(), fmt.emulated_reading


def facts(device: str = "cpu") -> dict:
    """Doctor's fact per low-precision dtype on ``device``, measured in this process.

    Returns :func:`mpnb.core.hardware.dtype_support`: ``{"bfloat16": DtypeSupport, "float16":
    ..., "float8_e4m3fn": ...}``, each with ``status``, ``speed_vs_fp32`` and ``reason``.
    """

    return dtype_support(device)


def _fact(facts: Mapping, dtype: str):
    """The fact for ``dtype`` (any of its names), however ``facts`` is keyed."""
    try:
        return lookup(facts, dtype)
    except KeyError as e:
        raise KeyError(f"{e.args[0]} (mpnb.lab.story.facts(device) returns them)") from None


def status(facts: Mapping, dtype: str) -> str:
    """``"native"``, ``"emulated"`` or ``"unsupported"``: doctor's fact for ``dtype``.

    Example::

        >>> status({"bfloat16": "native", "float16": "emulated"}, "fp16")
        'emulated'
    """
    _fact(facts, dtype)  # a missing fact raises here, naming where facts come from
    return status_of(facts, dtype)


def _where(device: str) -> str:
    return str(device).split(":")[0].upper()


def hardware(facts: Mapping, device: str = "cpu", dtypes: Sequence[str] = HALF_NAMES) -> str:
    """One sentence per dtype: doctor's fact on this device, what it means for mixed precision,
    and doctor's evidence when the fact carries it.

    Args:
        facts: :func:`facts` (or plain statuses, see the module docstring).
        device: ``"cpu"`` or ``"cuda"``, for the wording.
        dtypes: the dtypes to speak of (``"bf16"``, ``"fp16"``, ``"fp8"``).

    Example::

        >>> hardware({"bfloat16": "emulated", "float16": "emulated"}, dtypes=["bf16"])
        'On this CPU bf16 is emulated: it saves memory here, not time.'
    """
    out = []
    for d in dtypes:
        e, s = _fact(facts, d), status(facts, d)
        table = _format(short_name(d)).consequences
        consequence = table.get(s, "see mpnb doctor")
        reason = getattr(e, "reason", "")
        evidence = f" (doctor: {reason})" if reason else ""
        out.append(f"On this {_where(device)} {short_name(d)} is {s}: {consequence}.{evidence}")
    return "\n".join(out)


def _has_interval(lo, hi) -> bool:
    return lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi)


def direction(ratio: float, lo: float | None = None, hi: float | None = None) -> str:
    """``"faster"``, ``"slower"`` or ``"same"`` (the 95% interval contains 1.0) for a speed
    ratio (the baseline's time over the subject's). Without an interval the ratio decides.

    Example::

        >>> direction(1.3, 0.9, 1.6), direction(1.3), direction(0.5, 0.4, 0.6)
        ('same', 'faster', 'slower')
    """
    if _has_interval(lo, hi) and lo <= 1.0 <= hi:
        return "same"
    return "faster" if ratio >= 1.0 else "slower"


def speed(
    ratio: float,
    lo: float | None = None,
    hi: float | None = None,
    subject: str = "it",
    baseline: str = "O0",
) -> str:
    """The measured speed in words, with the same rule as every view's speed label.

    Example::

        >>> speed(0.5, 0.45, 0.55, "O3")
        'O3 ran 2.00x slower than O0 (95% interval 1.82x-2.22x)'
    """
    d = direction(ratio, lo, hi)
    if d == "same":
        return (
            f"{subject} ran at {ratio:.2f}x {baseline}'s speed, no measurable difference "
            f"(the 95% interval {lo:.2f}x-{hi:.2f}x contains 1)"
        )
    if d == "faster":
        ci = f" (95% interval {lo:.2f}x-{hi:.2f}x)" if _has_interval(lo, hi) else ""
        return f"{subject} ran {ratio:.2f}x faster than {baseline}{ci}"
    ci = f" (95% interval {1 / hi:.2f}x-{1 / lo:.2f}x)" if _has_interval(lo, hi) else ""
    return f"{subject} ran {1 / ratio:.2f}x slower than {baseline}{ci}"


#: why native ``{dtype}`` was not faster, by default: the work around its arithmetic
NOT_FASTER = (
    "at this size the casts to and from {dtype}, the per-op overhead and the ops that stay "
    "fp32 cost {cost} the faster arithmetic saves; larger sizes tip it towards {dtype}"
)


def _why(s: str, d: str, short: str, subject: str, where: str, not_faster: str) -> str:
    """The explanation that fact ``s`` gives measured direction ``d``."""
    if s == "emulated":
        what, left = _emulation(short)
        if d == "slower":
            return f"As expected where {short} is emulated, as on this {where}: {what}, so {left}."
        return (
            f"Unexpected where {short} is emulated, as on this {where} ({what}): at this size "
            f"{subject}'s time goes elsewhere (per-op overhead, ops that stay fp32), so the "
            "emulation does not show."
        )
    if s == "native":
        if d == "faster":
            return (
                f"{short} is native on this {where}, and its faster arithmetic shows at this size."
            )
        cost = "more than" if d == "slower" else "about as much as"
        why = not_faster.format(dtype=short, cost=cost)
        yet = "slower" if d == "slower" else "not faster"
        return f"{short} is native on this {where}, yet {yet} here: {why}."
    return f"{short} is {s} on this {where}: see mpnb doctor."


def outcome(
    facts: Mapping,
    dtype: str,
    ratio: float,
    lo: float | None = None,
    hi: float | None = None,
    subject: str = "it",
    baseline: str = "O0",
    device: str = "cpu",
    not_faster: str = NOT_FASTER,
) -> str:
    """The measured speed of ``subject`` (computing in ``dtype``) against an fp32 ``baseline``,
    and the explanation doctor's fact for ``dtype`` gives it.

    Args:
        facts: :func:`facts` (or plain statuses).
        dtype: the low-precision dtype ``subject`` computes in (``"bf16"``, ``"fp16"``,
            ``"fp8"``).
        ratio, lo, hi: the baseline's time over the subject's, and its 95% interval if any.
        subject, baseline: what the sentence names.
        device: for the wording.
        not_faster: why a native ``dtype`` was not faster, for a subject whose time is not a
            training step (:data:`NOT_FASTER` by default); ``{dtype}`` becomes its short name
            and ``{cost}`` ``"more than"`` or ``"about as much as"``.

    Example::

        >>> outcome({"bf16": "emulated"}, "bf16", 0.2, 0.18, 0.22, "O3")
        'Measured: O3 ran 5.00x slower than O0 (95% interval ...). As expected where bf16 ...'
    """
    short = short_name(dtype)
    d = direction(ratio, lo, hi)
    why = _why(status(facts, dtype), d, short, subject, _where(device), not_faster)
    return f"Measured: {speed(ratio, lo, hi, subject, baseline)}. {why}"


def _row_dtype_status(row, hw: Mapping) -> tuple[str, str] | None:
    """``(dtype, status)`` a compare row computed in, from its ``precision`` ("bf16 (native)",
    "fp8 (emulated)"); None for fp32 rows."""
    prec = str(row.get("precision", "") or "")
    if "(" in prec:
        name, st = prec.split("(", 1)
        return name.strip(), st.rstrip(")").strip()
    name, half = row.get("opt_level"), str(row.get("half_dtype", "") or "")
    if name not in config_names() or not half:
        return None
    st = get_config(name).status(half, hw)  # the configuration's own reading of the facts
    return (half, st) if st else None


def compare(df: pd.DataFrame) -> list[str]:
    """One :func:`outcome` line per measured low-precision row of a :func:`mpnb.lab.compare`
    DataFrame, against the fp32 baseline of its batch size.

    The fact is the row's own (its ``precision``, e.g. ``"bf16 (emulated)"``, which the runner
    took from doctor), the numbers its ``speedup_vs_O0`` and interval.

    Example::

        >>> for line in story.compare(df):
        ...     print(line)
    """
    hw = df.attrs.get("hardware", {})
    device = str(hw.get("device", "cpu"))
    ok = df[df["status"] == "ok"] if "status" in df else df
    lines = []
    for _, r in ok.iterrows():
        got = _row_dtype_status(r, hw)
        ratio = r.get("speedup_vs_O0", math.nan)
        if got is None or not (isinstance(ratio, float) and math.isfinite(ratio) and ratio > 0):
            continue
        dtype, st = got
        lines.append(
            outcome(
                {dtype: st},
                dtype,
                ratio,
                r.get("speedup_lo"),
                r.get("speedup_hi"),
                subject=str(r["configuration"]),
                baseline="O0",
                device=device,
            )
        )
    return lines


def fixed_cost(
    ratio: float, t_baseline: float, subject: str = "it", baseline: str = "the baseline"
) -> str:
    """A measured speed ratio between two ways of doing the same work, read as time per call.

    Args:
        ratio: the baseline's time over the subject's (the median of per-round ratios).
        t_baseline: the baseline's median seconds per call; the subject's time per call is
            taken as ``t_baseline / ratio``, so the two figures never disagree.
        subject, baseline: what the sentence names.

    Example::

        >>> fixed_cost(0.8, 1.0e-3, "mpnb.amp O1", "autocast + GradScaler")
        'Measured: mpnb.amp O1 at 0.80x the speed of autocast + GradScaler: 250 us more ...'
    """
    extra = t_baseline / ratio - t_baseline
    head = f"Measured: {subject} at {ratio:.2f}x the speed of {baseline}"
    if extra <= 0:
        return (
            f"{head}: {-extra * 1e6:.0f} us less per call of {t_baseline * 1e6:.0f} us, so "
            "nothing it adds shows at this size."
        )
    return (
        f"{head}: {extra * 1e6:.0f} us more per call of {t_baseline * 1e6:.0f} us "
        f"({extra / t_baseline:.0%} on top). Added to a 50 ms step, the same {extra * 1e6:.0f} us "
        f"would be {extra / 0.05:.1%}."
    )


def _names(dtypes: Sequence[str]) -> str:
    """``"bf16 is"``, ``"bf16 and fp8 are"``."""
    return f"{' and '.join(dtypes)} {'is' if len(dtypes) == 1 else 'are'}"


def emulated_clause(emulated: Sequence[str]) -> str:
    """``" (bf16 and fp8 are emulated here)"``, or ``""`` when nothing is emulated."""
    return f" ({_names(emulated)} emulated here)" if emulated else ""


def emulation_lines(emulated: Sequence[str], device: str = "cpu") -> list[str]:
    """The verdict's lines for the emulated formats among its rows (``"bf16"``, ``"fp16"``,
    ``"fp8"``): what emulation means for reading their speed. Empty when none is emulated.

    Example::

        >>> emulation_lines(["bf16"], "cpu")
        ['bf16 is emulated on this CPU (computed in software): half precision saves ...']
    """
    where = _where(device)
    lines = []
    halves = [d for d in emulated if not _format(d).scaled]
    if halves:
        lines.append(
            f"{_names(halves)} emulated on this {where} (computed in software): "
            "half precision saves memory here, not time."
        )
    for d in (d for d in emulated if _format(d).scaled):
        up = d.upper()
        lines.append(
            f"{d} is emulated on this {where} (no {up} matrix hardware in use; {up} numerics "
            f"computed in float32): its rows show {up}'s accuracy and memory, not {up}'s speed."
        )
    return lines


def row_note(short: str, device: str = "cpu", label: str = "") -> str:
    """A compare row's note for an emulated format (``"bf16"``, ``"fp16"``, ``"fp8"``): what
    emulation does here and what to read in the row. ``label`` names the configuration.

    Example::

        >>> row_note("bf16", "cpu")
        'bf16 is emulated on this CPU (PyTorch computes it in software in this process): ...'
    """
    what, read = _emulation(short)
    head = f"{label}: " if label else ""
    return (
        f"{head}{short} is emulated on this {_where(device)} (PyTorch computes it in software in "
        f"this process): {what}; {read}"
    )


def run_note(emulated: Sequence[str], device: str = "cpu", size: str = "") -> str:
    """The line a run prints up front when some of its formats are emulated ("" when none):
    they run several times slower than fp32, so the workload is kept small.

    Example::

        >>> run_note(["bf16"], "cpu", "small")
        "note: bf16 is emulated on this CPU (PyTorch computes it in software in this process): ..."
    """
    if not emulated:
        return ""
    sized = f"; the workload is sized '{size}'" if size else ""
    return (
        f"note: {_names(list(emulated))} emulated on this {_where(device)} (PyTorch computes "
        f"{'it' if len(emulated) == 1 else 'them'} in software in this process): low-precision "
        f"steps run several times slower than fp32 here{sized} so that the run still finishes "
        "in about a minute (--size medium/large for more)."
    )
