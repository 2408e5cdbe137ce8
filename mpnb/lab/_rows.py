"""From measured :class:`~mpnb.lab._train.RunResult` s to the DataFrame ``compare`` returns.

The speed figure is computed here, once, and every view (the bar, its label, the table, the
report, the CLI) reads the same three columns: ``speedup_vs_O0`` (the median of the
per-round ratios ``t_O0[k] / t_config[k]`` over the rounds where both were timed),
``speedup_lo``/``speedup_hi`` (a 95% bootstrap interval of that median) and ``speed_label``
(the text shown: ``"2.00x slower than O0"``, or ``"no measurable difference"`` when the
interval contains 1.0). :func:`relative_speed` compares any two rows the same way, from the
same per-round step times (the verdict's mpnb-vs-torch.amp sentence).

Columns beyond the names' plain meaning:

* ``status``: ``"ok"``, ``"error"`` (``error`` says what failed and the fix),
  ``"interrupted"`` (Stop, Ctrl-C, SIGTERM) or ``"unsupported"`` (the device cannot run the
  configuration, e.g. ``tf32`` off CUDA: ``error`` says why and where it runs; nothing trained).
* ``compile_s``: the seconds a compiling configuration (``torch-amp+compile``) spent compiling
  (the warm-up calls until one compiled nothing, plus any later step that compiled again),
  never part of ``step_time_ms`` or the speed figure; NaN for the configurations that compile
  nothing.
* ``host_syncs_per_step``: the host reads of device values (``item``, ``tolist``, ``bool`` and
  the like, blocking copies to the host) in the memory-tracked training step (forward,
  backward, optimizer step; not the lab's bookkeeping), counted by
  :class:`~mpnb.lab.host_reads.HostReads`: each one makes a CUDA host wait for the GPU.
* ``gpu_busy``, ``gpu_kernel_ms``: on CUDA, the share of one sampled step's wall time (the step
  after the memory-tracked one, run under ``torch.profiler`` and not timed) that the GPU spent
  in kernels, and those kernels' time (:func:`mpnb.lab.gpu_busy.measure_busy`): a low share
  says the row measured the host's launches, not the precision's arithmetic. NaN on a CPU.
* ``snippet``: the few lines a user writes to train this row's way in their own loop
  (:meth:`~mpnb.core.precision_configs.PrecisionConfig.snippet`), for its half dtype, device,
  optimizer and learning rate.
"""

from __future__ import annotations

import math

import pandas as pd
import torch

from mpnb.core.precision_configs import BASELINE
from mpnb.lab._train import RunResult
from mpnb.lab.memory import ROLES
from mpnb.lab.stats import median, median_ci
from mpnb.lab.story import row_note

__all__ = [
    "COLUMNS",
    "HISTORY_COLUMNS",
    "frames",
    "speed_label",
    "paired_ratios",
    "round_ratios",
    "relative_speed",
]

COLUMNS = (
    "configuration",
    "workload",
    "opt_level",
    "half_dtype",
    "precision",
    "batch_size",
    "samples_per_step",
    "steps",
    "steps_done",
    "optimizer",
    "device",
    "hardware",
    "status",
    "step_time_ms",
    "step_time_iqr_ms",
    "timed_steps",
    "rounds",
    "samples_per_s",
    "compile_s",
    "speedup_vs_O0",
    "speedup_lo",
    "speedup_hi",
    "speed_label",
    "peak_mem_mib",
    *[f"mem_{r}_mib" for r in ROLES],
    "mem_method",
    "mem_saving_vs_O0",
    "flops_per_step",
    "ops_per_step",
    "host_syncs_per_step",
    "gpu_busy",
    "gpu_kernel_ms",
    "final_loss",
    "eval_loss",
    "metric_name",
    "metric",
    "metric_vs_O0",
    "output_diff_vs_O0",
    "skipped_steps",
    "final_loss_scale",
    "warnings",
    "error",
    "snippet",
)

HISTORY_COLUMNS = [
    "configuration",
    "step",
    "loss",
    "loss_scale",
    "step_time_ms",
    "skipped",
    "skip_reason",
    "phase",
    "samples",
]


def speed_label(speedup: float, lo: float, hi: float, baseline: bool = False) -> str:
    """The one text every view shows for a speed figure.

    ``"baseline"`` for O0; ``"no measurable difference"`` when the interval ``[lo, hi]``
    contains 1.0; else ``"1.80x faster than O0"`` or ``"2.00x slower than O0"`` (slower:
    the ratio of step times, ``1 / speedup``).

    Example::

        >>> speed_label(0.5, 0.45, 0.55)
        '2.00x slower than O0'
    """
    if baseline:
        return "baseline"
    if speedup is None or not math.isfinite(speedup) or speedup <= 0:
        return "no speed figure"
    if math.isfinite(lo) and math.isfinite(hi) and lo <= 1.0 <= hi:
        return "no measurable difference"
    if speedup >= 1.0:
        return f"{speedup:.2f}x faster than O0"
    return f"{1.0 / speedup:.2f}x slower than O0"


def round_ratios(base_history, history) -> list[float]:
    """``t_base[k] / t[k]`` for every round ``k`` where both steps were timed (the histories:
    entries with ``step``, ``step_time_ms`` and ``phase``)."""
    t0 = {h["step"]: h["step_time_ms"] for h in base_history if h["phase"] == "timed"}
    return [
        t0[h["step"]] / h["step_time_ms"]
        for h in history
        if h["phase"] == "timed" and h["step"] in t0 and h["step_time_ms"] > 0
    ]


def paired_ratios(base: RunResult, res: RunResult) -> list[float]:
    """``t_O0[k] / t_config[k]`` for every round ``k`` where both steps were timed."""
    return round_ratios(base.history, res.history)


def relative_speed(history: pd.DataFrame, label: str, reference: str) -> dict:
    """How fast the row ``label`` ran relative to the row ``reference``, measured as the speed
    figure is: the median of the per-round ratios ``t_reference[k] / t_label[k]`` (> 1: faster)
    with its 95% bootstrap interval, from a frame's ``attrs["history"]``.

    Returns:
        ``dict(ratio=, lo=, hi=, rounds=)`` (NaN without 3 paired rounds).

    Example::

        >>> relative_speed(df.attrs["history"], "O2 bf16 b16", "torch-amp bf16 b16")
        {'ratio': 1.02, 'lo': 0.98, 'hi': 1.05, 'rounds': 40}
    """
    by = {k: g.to_dict("records") for k, g in history.groupby("configuration", sort=False)}
    ratios = round_ratios(by.get(reference, []), by.get(label, []))
    lo, hi = median_ci(ratios)
    ok = math.isfinite(lo) and math.isfinite(hi)
    return dict(ratio=median(ratios) if ok else math.nan, lo=lo, hi=hi, rounds=len(ratios))


#: a row's warnings are one string, one warning per line (a warning may hold "; " itself)
WARNING_SEP = "\n"


def join_warnings(parts) -> str:
    """One row's warnings as its ``warnings`` cell (empty parts dropped)."""
    return WARNING_SEP.join(p for p in parts if p)


def split_warnings(cell) -> list[str]:
    """The warnings of one ``warnings`` cell (``""``, NaN or None: none)."""
    return [w for w in cell.split(WARNING_SEP) if w] if isinstance(cell, str) else []


def _precision(cfg, hw: dict) -> tuple[str, list[str]]:
    """The row's precision text and its emulation note, as the configuration says them from
    the run's hardware facts (``hw``: :func:`~mpnb.lab.runner.hardware_summary`)."""
    pc, half = cfg.config, cfg.half_dtype
    status = pc.status(half, hw)
    notes = [row_note(half, str(hw["device"]), pc.note_subject)] if status == "emulated" else []
    return pc.precision_text(half, status), notes


def _rel_diff(out: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    if out is None or ref is None or out.shape != ref.shape:
        return math.nan
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _baseline(results: list[RunResult], cfg) -> RunResult | None:
    for r in results:
        c = r.config
        if c.config.name == BASELINE and c.batch_size == cfg.batch_size and r.error is None:
            return r
    return None


def _speed(res: RunResult, base: RunResult | None) -> dict:
    nan = math.nan
    if base is None or res.error is not None or not res.history:  # not started: no figure
        return dict(speedup_vs_O0=nan, speedup_lo=nan, speedup_hi=nan, rounds=0)
    ratios = paired_ratios(base, res)
    if res is base:
        return dict(speedup_vs_O0=1.0, speedup_lo=1.0, speedup_hi=1.0, rounds=len(ratios))
    lo, hi = median_ci(ratios)
    if ratios and not (math.isfinite(lo) and math.isfinite(hi)):
        # too few rounds for an interval: a ratio without one is no figure (the verdict,
        # which needs the interval, would call it no faster while the label said faster)
        return dict(speedup_vs_O0=nan, speedup_lo=nan, speedup_hi=nan, rounds=len(ratios))
    return dict(speedup_vs_O0=median(ratios), speedup_lo=lo, speedup_hi=hi, rounds=len(ratios))


def too_few_rounds(rounds: int) -> str:
    """The speed label of a row timed in too few rounds for a 95% interval."""
    return (
        f"too few timed steps for a speed figure ({rounds} round{'s' * (rounds != 1)} paired "
        "with O0, no 95% interval); run more steps"
    )


def _clamp_note(batch_size: int, samples: float) -> str:
    """The warning for a batch the data could not fill (clamped to the data set's size)."""
    if not math.isfinite(samples) or samples >= batch_size:
        return ""
    return (
        f"batch size {batch_size} clamped to {samples:.0f} samples (the data set's size); "
        f"samples/s counts the {samples:.0f} samples a step really trains on"
    )


def _status(res: RunResult) -> str:
    if res.unsupported:
        return "unsupported"
    return "error" if res.error else "interrupted" if res.interrupted else "ok"


def _row(res: RunResult, base: RunResult | None, w, hw: dict) -> dict:
    cfg, nan = res.config, math.nan
    precision, notes = _precision(cfg, hw)
    row = dict(
        configuration=cfg.label,
        workload=w.name,
        opt_level=cfg.config.name,
        half_dtype=cfg.half_dtype,
        precision=precision,
        batch_size=cfg.batch_size,
        steps=cfg.steps,
        steps_done=len(res.history),  # fewer than steps when Stop or Ctrl-C came first
        optimizer=cfg.optimizer,
        device=cfg.device,
        hardware=hw["summary"],
        metric_name=w.metric_name,
    )
    row.update(res.row)
    row.update(_speed(res, base))
    baseline = res is base and bool(res.history)  # an O0 that never started has no figure
    if res.unsupported:
        row["speed_label"] = "not run (unsupported here)"
    elif res.error:
        row["speed_label"] = "failed"
    elif res is not base and row["rounds"] and not math.isfinite(row["speedup_vs_O0"]):
        row["speed_label"] = too_few_rounds(row["rounds"])
    else:
        row["speed_label"] = speed_label(
            row["speedup_vs_O0"], row["speedup_lo"], row["speedup_hi"], baseline
        )
    ok = res.error is None and base is not None
    bpeak = base.row.get("peak_mem_mib", nan) if base else nan
    row.update(
        mem_saving_vs_O0=1 - row.get("peak_mem_mib", nan) / bpeak if ok else nan,
        metric_vs_O0=row.get("metric", nan) - base.row.get("metric", nan) if ok else nan,
        output_diff_vs_O0=_rel_diff(res.output, base.output) if ok else nan,
        warnings=join_warnings(dict.fromkeys([*notes, *res.warnings, res.interrupted])),
        error=res.error or "",
        status=_status(res),
        snippet=cfg.config.snippet(cfg.half_dtype, cfg.device, cfg.optimizer, cfg.lr or w.lr),
    )
    biggest = max((h["samples"] for h in res.history), default=nan)
    clamped = _clamp_note(cfg.batch_size, biggest)
    if clamped:
        row["warnings"] = join_warnings([clamped, row["warnings"]])
    if base is None and res.error is None:
        row["warnings"] = join_warnings([row["warnings"], "no O0 row to compare with"])
    return {c: row.get(c, nan) for c in COLUMNS}


def frames(results: list[RunResult], w, hw: dict) -> pd.DataFrame:
    """The DataFrame of ``results`` with ``attrs["history"]`` (one row per step)."""
    rows = [_row(r, _baseline(results, r.config), w, hw) for r in results]
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    hist = [dict(configuration=r.config.label, **h) for r in results for h in r.history]
    df.attrs["history"] = pd.DataFrame(hist, columns=HISTORY_COLUMNS)
    df.attrs["hardware"] = hw
    return df
