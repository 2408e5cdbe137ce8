"""The verdict: a short recommendation computed from the measured rows and the hardware.

:func:`verdict` reads a :func:`mpnb.lab.compare` DataFrame and says which configuration is
fastest within an accuracy tolerance (only if it is *measurably* faster than O0), how mpnb's
best row compares with torch.amp's on this model and device (:func:`versus_reference`: the
median of the per-round step-time ratios of the two rows, with its 95% interval, as every
speed figure is measured), which saves most memory, which formats (half dtypes, FP8) were
emulated, and, clearly labelled as an estimate, what a GPU with native half precision would
likely show.

The estimate is a roofline from what the run measured: the FLOPs of one training step
(``torch.utils.flop_counter``), the bytes it touches (the memory breakdown by role, each
read and written about twice per step) and the ops it dispatches (one kernel launch each,
about :data:`LAUNCH_US` microseconds of overhead on a GPU), against the published dense
peak throughputs and memory bandwidths in :data:`GPU_PEAKS`::

    t(config) = max(flops / peak[dtype], bytes / bandwidth) + ops * LAUNCH_US

Real GPUs reach a fraction of their peaks; the estimate assumes the same fraction for every
configuration, so only the ratio to O0 is reported.

Example::

    >>> v = verdict(df)
    >>> print(v["text"])
"""

from __future__ import annotations

import math
import re

import pandas as pd

from mpnb.core.dtype_names import HALF_NAMES
from mpnb.core.precision_configs import BASELINE, get_config
from mpnb.lab._versus import versus_reference
from mpnb.lab.memory import ROLES as _ROLES
from mpnb.lab.story import emulated_clause, emulation_lines

__all__ = [
    "CARD_NAMES",
    "GPU_PEAKS",
    "LAUNCH_US",
    "REFERENCE_GPU",
    "estimate_for_card",
    "gpu_estimate",
    "measured_rows",
    "verdict",
    "versus_reference",
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
#: typical eager-mode cost of one op (Python dispatch + kernel launch) on a GPU, microseconds
LAUNCH_US = 5.0
#: default accuracy tolerance: a configuration is "as accurate" as O0 within this much metric
TOLERANCE = 0.02


def _bytes(row) -> float:
    total = sum(float(row.get(f"mem_{r}_mib", 0.0) or 0.0) for r in _ROLES)
    return 2.0 * total * 2**20  # each tensor is written and read about once per step


def _gemm_dtype(row) -> str:
    """The dtype a row's GEMMs would run in on a GPU, as its configuration says (a GEMM
    emulated on every device, as MXFP8's, runs in fp32 and gets the fp32 rate)."""
    return get_config(row["opt_level"]).gemm_dtype(row["half_dtype"])


def _step_time(row, gpu: dict) -> float:
    dtype = _gemm_dtype(row)
    peak = gpu.get(dtype) or gpu["fp32"]  # no tensor cores for it: fp32 rate
    flops = float(row.get("flops_per_step", math.nan))
    ops = float(row.get("ops_per_step", 0.0) or 0.0)
    compute = flops / (peak * 1e12)
    memory = _bytes(row) / (gpu["gbps"] * 1e9)
    return max(compute, memory) + ops * LAUNCH_US * 1e-6


def gpu_estimate(df: pd.DataFrame) -> pd.DataFrame:
    """Estimated speed-up vs O0 per GPU of :data:`GPU_PEAKS` and configuration (not measured).

    Columns: ``gpu``, ``configuration``, ``est_step_ms``, ``est_speedup_vs_O0``,
    ``bound`` (``"compute"``, ``"memory"`` or ``"launch overhead"``).
    """
    ok = df[(df["status"] != "error") & df["flops_per_step"].notna()]
    rows = []
    for gpu, peaks in GPU_PEAKS.items():
        for _, grp in ok.groupby("batch_size", sort=False):
            base = grp[grp["opt_level"] == BASELINE]
            if base.empty:
                continue
            t0 = _step_time(base.iloc[0], peaks)
            for _, r in grp.iterrows():
                t = _step_time(r, peaks)
                dtype = _gemm_dtype(r)
                parts = {
                    "compute": r["flops_per_step"] / ((peaks.get(dtype) or peaks["fp32"]) * 1e12),
                    "memory": _bytes(r) / (peaks["gbps"] * 1e9),
                    "launch overhead": (r["ops_per_step"] or 0.0) * LAUNCH_US * 1e-6,
                }
                rows.append(
                    dict(
                        gpu=gpu,
                        configuration=r["configuration"],
                        est_step_ms=t * 1e3,
                        est_speedup_vs_O0=t0 / t if t > 0 else math.nan,
                        bound=max(parts, key=parts.get),
                    )
                )
    cols = ["gpu", "configuration", "est_step_ms", "est_speedup_vs_O0", "bound"]
    return pd.DataFrame(rows, columns=cols)


def estimate_for_card(df: pd.DataFrame, card: str) -> pd.DataFrame:
    """:func:`gpu_estimate`'s rows for the GPU named ``card`` as torch reports it
    (``"NVIDIA H100 80GB HBM3"``); empty when :data:`GPU_PEAKS` has no entry for it.

    Example::

        >>> estimate_for_card(cpu_df, torch.cuda.get_device_name())["est_speedup_vs_O0"]
    """
    key = next((k for pattern, k in CARD_NAMES if re.search(pattern, card)), None)
    est = gpu_estimate(df) if key is not None else pd.DataFrame()
    return est[est["gpu"] == key].reset_index(drop=True) if len(est) else est


def _fmt_metric(v: float) -> str:
    return f"{v:.3f}" if math.isfinite(v) else "-"


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
    if "precision" in ok and ok["precision"].astype(str).eq("fp8 (emulated)").any():
        emulated.append("fp8")
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
