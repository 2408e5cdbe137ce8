"""The verdict: a short recommendation computed from the measured rows and the hardware.

:func:`verdict` reads a :func:`mpnb.lab.compare` DataFrame and says which configuration is
fastest within an accuracy tolerance (only if it is *measurably* faster than O0), which
saves most memory, how mpnb's best row compares with torch.amp's (the peer rows), which
formats (half dtypes, FP8) were emulated, whether the GPU was busy or waited on the host
(:func:`mpnb.lab.gpu_busy.busy_note`), and, clearly labelled as an estimate, what a GPU with
native half precision would likely show (:mod:`mpnb.lab.gpu_estimate`: host dispatch, host
syncs, kernel time from FLOPs and bytes, and their overlap, per measured row).

Example::

    >>> v = verdict(df)
    >>> print(v["text"])
"""

from __future__ import annotations

import math

import pandas as pd

from mpnb.core.dtype_names import HALF_NAMES
from mpnb.core.number_formats import read_precision
from mpnb.core.precision_configs import BASELINE
from mpnb.lab._versus import versus_reference
from mpnb.lab.gpu_busy import busy_note
from mpnb.lab.gpu_estimate import (
    CARD_NAMES,
    GPU_PEAKS,
    REFERENCE_GPU,
    estimate_for_card,
    gpu_estimate,
)
from mpnb.lab.story import emulated_clause, emulation_lines

__all__ = [
    "CARD_NAMES",
    "GPU_PEAKS",
    "REFERENCE_GPU",
    "estimate_for_card",
    "gpu_estimate",
    "measured_rows",
    "verdict",
]

#: default accuracy tolerance: a configuration is "as accurate" as O0 within this much metric
TOLERANCE = 0.02


def _fmt_metric(v: float) -> str:
    return f"{v:.3f}" if math.isfinite(v) else "-"


def _emulated_scaled(ok) -> list[str]:
    """The scaled formats (FP8, MX, NVFP4) that ``ok``'s rows ran emulated: each row's
    ``precision`` cell read back into its format and status, not matched as text."""
    out = []
    for cell in ok["precision"].astype(str).unique() if "precision" in ok else ():
        fmt, status = read_precision(cell)
        if fmt is not None and fmt.scaled and status == "emulated" and fmt.name not in out:
            out.append(fmt.name)
    return out


def _accurate(df: pd.DataFrame, tol: float) -> pd.Series:
    d = df["metric_vs_O0"]
    return d.isna() | (d >= -tol)


def verdict(df: pd.DataFrame, tolerance: float = TOLERANCE) -> dict:
    """A short recommendation from ``df``'s measured rows; see the module docstring.

    Args:
        df: a :func:`mpnb.lab.compare` DataFrame (with ``attrs["hardware"]``).
        tolerance: the largest metric loss vs O0 that still counts as "as accurate".

    Returns:
        ``dict(text=..., recommendation=..., fastest=..., smallest=..., emulated=[...],
        tolerance=..., gpu_estimate=[...], versus_reference=...)``: ``text`` is the lines
        every view prints; ``emulated`` names the emulated formats among the measured rows
        (``"bf16"``, ``"fp16"``, ``"fp8"``); ``versus_reference`` is
        :func:`versus_reference`'s dict (None without both rows).
    """
    hw = df.attrs.get("hardware", {})
    ok = measured_rows(df)
    halves = [c for c in ok["half_dtype"].unique() if c in HALF_NAMES]
    emulated = [h for h in halves if hw.get(h) == "emulated"]
    emulated += _emulated_scaled(ok)
    acc = ok[_accurate(ok, tolerance) & (ok["opt_level"] != BASELINE)]
    faster = acc[acc["speedup_lo"] > 1.0]
    fastest = faster.loc[faster["speedup_vs_O0"].idxmax()] if len(faster) else None
    saving = acc[acc["mem_saving_vs_O0"] > 0.005]
    smallest = saving.loc[saving["mem_saving_vs_O0"].idxmax()] if len(saving) else None
    lines = []
    has_metric = bool(len(ok)) and ok["metric"].notna().any()
    if fastest is not None and has_metric:
        lines.append(
            f"Fastest within {tolerance:g} {ok['metric_name'].iloc[0]} of O0: "
            f"{fastest['configuration']}, {fastest['speed_label']}."
        )
    elif fastest is not None:
        lines.append(
            f"Fastest: {fastest['configuration']}, {fastest['speed_label']} (no metric was "
            "measured, so its accuracy is not checked)."
        )
    elif len(ok):
        lines.append("No configuration is measurably faster than O0 on this machine.")
    if smallest is not None:
        lines.append(
            f"Most memory saved: {smallest['configuration']}, peak "
            f"{smallest['peak_mem_mib']:.1f} MiB vs O0's "
            f"{smallest['peak_mem_mib'] / (1 - smallest['mem_saving_vs_O0']):.1f} MiB "
            f"({smallest['mem_saving_vs_O0']:.0%} less)."
        )
    worse = ok[~_accurate(ok, tolerance)]
    for _, r in worse.iterrows():
        lines.append(
            f"{r['configuration']} loses {-r['metric_vs_O0']:.3f} {r['metric_name']} vs O0 "
            f"(beyond the {tolerance:g} tolerance): {_fmt_metric(r['metric'])}."
        )
    versus = versus_reference(df, ok)  # mpnb's best against torch.amp
    if versus:
        lines.append(versus["text"])
    for _, r in df[df["status"] == "error"].iterrows():
        lines.append(f"{r['configuration']} failed: see its error.")
    for _, r in df[df["status"] == "unsupported"].iterrows():
        lines.append(f"Not run: {r['error']}.")
    lines += _interrupted_lines(df)
    busy = busy_note(ok)
    if busy:
        lines.append(busy)
    lines += emulation_lines(emulated, str(hw.get("device", "cpu")))
    est = gpu_estimate(df) if "flops_per_step" in df else pd.DataFrame()
    lines += _estimate_lines(est, hw)
    load = df.attrs.get("load", {})
    if load.get("competed"):
        lines.append(load["note"])
    rec = _interrupted_recommendation(df, ok, _recommendation(fastest, smallest, emulated, ok))
    return dict(
        text="\n".join([rec, *lines]),
        recommendation=rec,
        fastest=None if fastest is None else fastest["configuration"],
        smallest=None if smallest is None else smallest["configuration"],
        emulated=emulated,
        tolerance=tolerance,
        gpu_estimate=est.to_dict(orient="records"),
        versus_reference=versus,
    )


def measured_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows a verdict can read: finished ones, and those a Stop or Ctrl-C interrupted after
    at least one step (their speed and memory are what they measured; they have no metric).

    Example::

        >>> measured_rows(df)["configuration"].tolist()
        ['O0 fp32 b16', 'O2 bf16 b16']
    """
    if "status" not in df:
        return df[df["error"] == ""]
    return df[(df["status"] == "ok") | ((df["status"] == "interrupted") & (_done(df) > 0))]


def _done(df: pd.DataFrame) -> pd.Series:
    """Steps each row ran (a frame without the count: its timed steps, or taken as ran)."""
    for col in ("steps_done", "timed_steps"):
        if col in df:
            return df[col].fillna(0)
    return pd.Series(1, index=df.index)


def _interrupted(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(rows interrupted after some steps, rows that never started)."""
    if "status" not in df:
        return df.iloc[0:0], df.iloc[0:0]
    stopped = df[df["status"] == "interrupted"]
    done = _done(stopped)
    return stopped[done > 0], stopped[done == 0]


def _interrupted_after(df: pd.DataFrame) -> str:
    """``"interrupted after 22 of 400 steps"`` (the steps every interrupted row finished)."""
    cut, _ = _interrupted(df)
    if not len(cut) or "steps_done" not in cut:
        return "interrupted"
    return f"interrupted after {int(cut['steps_done'].min())} of {int(cut['steps'].max())} steps"


def _interrupted_lines(df: pd.DataFrame) -> list[str]:
    """What a Stop or Ctrl-C left out: the held-out metric, the configurations never started."""
    cut, never = _interrupted(df)
    lines = []
    if len(cut):
        lines.append(
            f"{', '.join(cut['configuration'])}: {_interrupted_after(df)}; no held-out metric "
            "(the evaluation runs after the last step), so accuracy is not checked; the loss "
            "curves show the steps that ran."
        )
    if len(never):
        lines.append(f"Not started (stopped first): {', '.join(never['configuration'])}.")
    return lines


def _interrupted_recommendation(df: pd.DataFrame, ok: pd.DataFrame, rec: str) -> str:
    """``rec`` as measured by an interrupted run: said so, or "too little was measured"."""
    cut, never = _interrupted(df)
    if not len(cut) and not len(never):
        return rec
    if not len(cut):  # the rows that ran finished; later batch sizes never started
        body = rec.removeprefix("Verdict: ")
        return f"Verdict, stopped before {len(never)} configuration(s) started: {body}"
    when = _interrupted_after(df)
    others = ok[ok["opt_level"] != BASELINE]
    measured = others["speedup_lo"].notna() | others["mem_saving_vs_O0"].notna()
    if len(others) and not measured.any() or not len(ok):
        return (
            f"Verdict: {when}: too little was measured for a verdict (no configuration has a "
            "speed interval or a memory reading yet); run again and stop later, or let it finish."
        )
    body = rec.removeprefix("Verdict: ").rstrip(".")
    return f"Verdict, {when}: {body} (fewer steps than asked; intervals wider)."


def _recommendation(fastest, smallest, emulated, ok) -> str:
    if not len(ok):
        return "Verdict: every configuration failed; see the errors."
    if fastest is not None:
        return f"Verdict: use {fastest['configuration']} ({fastest['speed_label']})."
    if smallest is not None:
        why = emulated_clause(emulated)
        return (
            f"Verdict: for speed stay with O0 on this machine{why}; if memory is the limit, "
            f"{smallest['configuration']} saves {smallest['mem_saving_vs_O0']:.0%}."
        )
    return "Verdict: O0 (fp32); no configuration was measurably better here."


def _estimate_lines(est: pd.DataFrame, hw: dict) -> list[str]:
    if est.empty:
        return []
    if str(hw.get("device", "cpu")).startswith("cuda") and "emulated" not in map(
        hw.get, HALF_NAMES
    ):
        return []  # measured on a GPU with native half: no estimate needed
    ref = est[(est["gpu"] == REFERENCE_GPU) & (est["est_speedup_vs_O0"].notna())]
    half = ref[~ref["configuration"].str.startswith(BASELINE)]
    if half.empty:
        return []
    best = half.loc[half["est_speedup_vs_O0"].idxmax()]
    p = GPU_PEAKS[REFERENCE_GPU]
    return [
        f"Estimate, not measured: on an {REFERENCE_GPU} ({p['bf16']:.0f} TFLOP/s half, "
        f"{p['fp32']} fp32, {p['gbps'] / 1e3:.1f} TB/s) {best['configuration']} would run "
        f"about {best['est_speedup_vs_O0']:.1f}x O0's speed ({best['bound']}-bound at this "
        "size; from the measured FLOPs, bytes and ops per step)."
    ]
