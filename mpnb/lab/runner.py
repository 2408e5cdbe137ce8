"""``compare``: the same workload under O0/O1/O2/O3, one DataFrame row per configuration.

Method: every configuration starts from the same seed (same initial weights, same data
order). By default the configurations train **round-robin in one process** (step ``i`` of
each, in an order rotated every step), so a shared machine's drift slows them alike; the
speed-up vs O0 is the median of the per-step ratios ``t_O0 / t_config`` over the timed steps
(as in ``mpnb bench``). ``isolate=True`` instead runs each configuration alone in a fresh
subprocess (no shared caches or allocator state; the ratios then pair steps of separate runs).

A configuration that fails (unsupported dtype, out of memory, NaN divergence, an exception in
your code) becomes a row with ``error`` set; the others still run.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
from collections.abc import Sequence

import pandas as pd
import torch

from mpnb.core.hardware import cpu_info, cuda_info, half_support
from mpnb.lab import workloads as _workloads
from mpnb.lab._train import RunResult, Trainer, describe_error
from mpnb.lab.bench._stats import median
from mpnb.lab.config import RunConfig, expand
from mpnb.lab.memory import ROLES

__all__ = ["compare", "hardware_summary", "COLUMNS"]

COLUMNS = (
    "configuration",
    "workload",
    "opt_level",
    "half_dtype",
    "precision",
    "batch_size",
    "steps",
    "optimizer",
    "device",
    "hardware",
    "step_time_ms",
    "step_time_iqr_ms",
    "timed_steps",
    "samples_per_s",
    "speedup_vs_O0",
    "peak_mem_mib",
    *[f"mem_{r}_mib" for r in ROLES],
    "mem_method",
    "mem_saving_vs_O0",
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
)


def hardware_summary(device: str = "cpu") -> dict:
    """What the runs ran on: device, CPU/GPU model, threads, torch, native/emulated halves.

    Example::

        >>> hardware_summary("cpu")["bf16"]
        'emulated'
    """
    cpu, hs = cpu_info(), half_support(device)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    out = {
        "device": device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_avg": load,
        "cpu": cpu.model,
        "isa": cpu.isa,
        "bf16": hs["bfloat16"],
        "fp16": hs["float16"],
    }
    if torch.device(device).type == "cuda":
        out["gpu"] = cuda_info(torch.device(device).index or 0)
        name = out["gpu"]["name"]
    else:
        name = f"{cpu.model} ({cpu.isa}, {out['threads']} threads)"
    out["summary"] = f"{name}; bf16 {hs['bfloat16']}, fp16 {hs['float16']}"
    if load > (out["cpus"] or 1):
        out["summary"] += (
            f"; load average {load:.1f} on {out['cpus']} CPUs: other processes "
            "compete, timings are noisy"
        )
    return out


@contextlib.contextmanager
def _threads(n: int | None):
    old = torch.get_num_threads()
    if n is not None:
        if n < 1:
            raise ValueError(f"threads={n!r}: need a positive int or None (torch's default).")
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _precision(cfg: RunConfig, hw: dict) -> tuple[str, list[str]]:
    if cfg.opt_level == "O0":
        return "fp32", []
    status = hw[cfg.half_dtype]
    notes = []
    if status == "emulated":
        notes.append(
            f"{cfg.half_dtype} is emulated on this {hw['device']} (no native "
            f"{cfg.half_dtype} instructions): expect it slower than fp32, not faster"
        )
    return f"{cfg.half_dtype} ({status})", notes


def _interleaved(trainers: list[Trainer], steps: int, bar) -> list[RunResult]:
    for i in range(steps):
        k = i % len(trainers)
        for t in trainers[k:] + trainers[:k]:  # rotate who goes first each step
            if t.alive:
                t.step(i)
            bar.update(1)
    return [t.finish() for t in trainers]


def _run_isolated(cfg: RunConfig, workload, threads: int | None) -> RunResult:
    from mpnb.lab._train import run_config

    if threads is not None:
        torch.set_num_threads(threads)  # a fresh process of its own: nothing to restore
    return run_config(cfg, _workloads.get(workload))


def _isolated(configs, workload, w, bar, threads) -> list[RunResult]:
    import concurrent.futures as cf
    import multiprocessing as mp

    spec = workload if isinstance(workload, str) else w
    out = []
    for cfg in configs:
        try:
            pickle.dumps(spec)
            with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
                out.append(ex.submit(_run_isolated, cfg, spec, threads).result())
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            res = RunResult(
                cfg,
                error="isolate=True needs a picklable workload (model_fn, "
                "loss_fn, metric_fn defined at module level, not lambdas): " + describe_error(e),
            )
            out.append(res)
        except Exception as e:  # noqa: BLE001 - a crashed subprocess is this row's error
            out.append(RunResult(cfg, error="the subprocess failed: " + describe_error(e)))
        bar.update(cfg.steps)
    return out


def _baseline(results: list[RunResult], cfg: RunConfig) -> RunResult | None:
    for r in results:
        c = r.config
        if c.opt_level == "O0" and c.batch_size == cfg.batch_size and r.error is None:
            return r
    return None


def _paired_speedup(base: RunResult, res: RunResult) -> float:
    t0 = {h["step"]: h["step_time_ms"] for h in base.history if h["phase"] == "timed"}
    ratios = [
        t0[h["step"]] / h["step_time_ms"]
        for h in res.history
        if h["phase"] == "timed" and h["step"] in t0 and h["step_time_ms"] > 0
    ]
    return median(ratios)


def _rel_diff(out: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    if out is None or ref is None or out.shape != ref.shape:
        return math.nan
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _row(res: RunResult, base: RunResult | None, w, hw: dict) -> dict:
    cfg, nan = res.config, math.nan
    precision, notes = _precision(cfg, hw)
    row = dict(
        configuration=cfg.label,
        workload=w.name,
        opt_level=cfg.opt_level,
        half_dtype=cfg.half_dtype,
        precision=precision,
        batch_size=cfg.batch_size,
        steps=cfg.steps,
        optimizer=cfg.optimizer,
        device=cfg.device,
        hardware=hw["summary"],
        metric_name=w.metric_name,
    )
    row.update(res.row)
    ok = res.error is None and base is not None
    bpeak = base.row.get("peak_mem_mib", nan) if base else nan
    row.update(
        speedup_vs_O0=_paired_speedup(base, res) if ok else nan,
        mem_saving_vs_O0=1 - row.get("peak_mem_mib", nan) / bpeak if ok else nan,
        metric_vs_O0=row.get("metric", nan) - base.row.get("metric", nan) if ok else nan,
        output_diff_vs_O0=_rel_diff(res.output, base.output) if ok else nan,
        warnings="; ".join(notes + res.warnings),
        error=res.error or "",
    )
    if base is None and res.error is None:
        row["warnings"] = "; ".join(filter(None, [row["warnings"], "no O0 row to compare with"]))
    return {c: row.get(c, nan) for c in COLUMNS}


def _frames(results: list[RunResult], w, hw: dict) -> pd.DataFrame:
    rows = [_row(r, _baseline(results, r.config), w, hw) for r in results]
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    hist = [dict(configuration=r.config.label, **h) for r in results for h in r.history]
    df.attrs["history"] = pd.DataFrame(
        hist,
        columns=[
            "configuration",
            "step",
            "loss",
            "loss_scale",
            "step_time_ms",
            "skipped",
            "skip_reason",
            "phase",
        ],
    )
    df.attrs["hardware"] = hw
    return df


def _progress(total: int, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency; without it, no bar
        enabled = False
    if not enabled:

        class _Null:
            def update(self, n=1): ...
            def close(self): ...

        return _Null()
    return tqdm(total=total, desc="mpnb compare", unit="step", leave=False, mininterval=1.0)


def compare(
    workload="mlp",
    opt_levels: Sequence[str] = ("O0", "O1", "O2", "O3"),
    half_dtype="auto",
    batch_sizes: Sequence[int] | None = None,
    steps: int | None = None,
    optimizer: str = "adam",
    lr: float | None = None,
    loss_scale=None,
    device="auto",
    seed: int = 0,
    progress: bool = True,
    isolate: bool = False,
    threads: int | None = None,
) -> pd.DataFrame:
    """Train ``workload`` under each opt level (and half dtype, batch size); one row each.

    Args:
        workload: a built-in name (``"mlp"``, ``"cnn"``, ``"transformer"``) or a
            :class:`~mpnb.lab.workloads.Workload` (see :func:`~mpnb.lab.workloads.custom`).
        opt_levels: any of ``"O0"`` .. ``"O3"``.
        half_dtype: ``"bf16"``, ``"fp16"``, ``"auto"`` (bf16 on CPU, fp16 on CUDA) or a list.
        batch_sizes: default: the workload's.
        steps: optimizer steps per configuration (default: the workload's).
        optimizer: ``"adam"``, ``"adamw"``, ``"sgd"``, ``"fused_adam"``, ``"fused_sgd"``.
        lr: learning rate (default: the workload's).
        loss_scale: for O1-O3: None (the level's default), a static number, or
            ``dict(init_scale=, growth_factor=, backoff_factor=, growth_interval=)``.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        seed: initial weights and data order, the same for every configuration.
        progress: show a progress bar (stderr).
        isolate: run each configuration in a fresh subprocess.
        threads: ``torch.set_num_threads`` for the runs (restored afterwards; None: leave
            it). On a shared or oversubscribed CPU, 1 thread is often far faster.

    Returns:
        A DataFrame with :data:`COLUMNS`; ``df.attrs["history"]`` holds the per-step loss,
        loss scale, step time and skipped steps (long format), ``df.attrs["hardware"]`` the
        :func:`hardware_summary`.

    Example::

        >>> df = mpnb.lab.compare("mlp", steps=60)
        >>> df[["configuration", "step_time_ms", "speedup_vs_O0", "metric"]]
    """
    w = _workloads.get(workload)
    configs = expand(
        w.name,
        opt_levels,
        half_dtype,
        batch_sizes or (w.batch_size,),
        steps or w.steps,
        optimizer,
        lr,
        loss_scale,
        device,
        seed,
    )
    with _threads(threads):
        hw = hardware_summary(configs[0].device)
        bar = _progress(sum(c.steps for c in configs), progress)
        try:
            if isolate:
                results = _isolated(configs, workload, w, bar, threads)
            else:
                results = _interleaved([Trainer(c, w) for c in configs], configs[0].steps, bar)
        finally:
            bar.close()
    df = _frames(results, w, hw)
    df.attrs["method"] = "isolated subprocesses" if isolate else "round-robin in one process"
    return df
