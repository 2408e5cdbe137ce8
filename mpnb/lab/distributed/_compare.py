"""The distributed comparison: launch the ranks, build one row per policy.

Called by :func:`mpnb.lab.compare` with ``ranks >= 2`` and by ``python -m
mpnb.lab.distributed`` (under torchrun too).
"""

from __future__ import annotations

import glob
import json
import math
import os
import pickle
import tempfile
from dataclasses import dataclass

import pandas as pd
import torch

from mpnb.core.parallel import RankError, launch
from mpnb.core.parallel.launch import cpus_available
from mpnb.core.precision_configs import distributed_names, get_distributed_config, make_optimizer
from mpnb.lab import workloads
from mpnb.lab._isolate import sigterm_interrupts, stop_label
from mpnb.lab._rows import COLUMNS
from mpnb.lab._train import forward, to_device
from mpnb.lab.distributed import DIST_COLUMNS
from mpnb.lab.distributed._rank import MEASURE_STEPS, progress_path, run_rank
from mpnb.lab.machine import hardware_summary
from mpnb.lab.stats import iqr, median, median_ci

__all__ = [
    "compare_distributed",
    "check_limits",
    "reference_run",
    "rows_of",
    "resolve_policies",
    "launched",
]


def resolve_policies(configs, strategy: str | None, device: str) -> tuple[list, dict]:
    """The policies to run and the ones this device does not offer (name -> reason)."""

    names = distributed_names(strategy)
    if configs is not None:
        picked = [get_distributed_config(c) for c in configs]
        if strategy not in (None, "both"):
            wrong = [c.name for c in picked if c.strategy != strategy]
            if wrong:
                raise ValueError(
                    f"compare: policies {', '.join(wrong)} are not {strategy!r} policies; "
                    f"name {strategy} policies ({', '.join(names)}) or leave strategy out."
                )
    else:
        picked = [get_distributed_config(n) for n in names]
    run, skipped = [], {}
    for c in picked:
        why = c.unavailable(device)
        if why:
            skipped[c.name] = (c, why)
        else:
            run.append(c)
    return run, skipped


def reference_run(w, job: dict) -> dict:
    """The single-process fp32 run on the same global batches: losses, metric, FLOPs/step."""
    # torch's FLOP counter, when FLOPs are asked for: +195 ms to import
    from torch.utils.flop_counter import FlopCounterMode

    dev = job["device"]
    torch.manual_seed(job["seed"])
    model = w.model_fn().to(dev)
    opt = make_optimizer(job["optimizer"], model.parameters(), job["lr"] or w.lr)
    batches, losses, flops = w.batches(job["global_batch"], job["seed"]), [], math.nan
    for i in range(job["steps"]):
        x, y = next(batches)
        x, y = to_device(x, dev), to_device(y, dev)
        opt.zero_grad(set_to_none=True)
        counter = FlopCounterMode(display=False) if i == 0 else None
        if counter is not None:
            with counter:
                loss = w.loss_fn(forward(model, x), y)
                loss.backward()
            flops = float(counter.get_total_flops())
        else:
            loss = w.loss_fn(forward(model, x), y)
            loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    metric = math.nan
    if w.metric_fn is not None:
        x, y = w.fixed_batch(64)
        model.eval()
        with torch.no_grad():
            metric = float(w.metric_fn(forward(model, to_device(x, dev)), to_device(y, dev)))
    return dict(losses=losses, metric=metric, flops_per_step=flops)


def launched(spec, configs: list, job: dict, folder: str | None) -> list[dict]:
    """A rank's entry under :func:`mpnb.core.parallel.launch` (importable, so ranks spawn)."""

    w = workloads.get(spec[0], spec[1]) if isinstance(spec, tuple) else spec
    return run_rank(w, configs, job, folder)


def _read_records(folder: str) -> list[dict]:
    """Every rank's records; a line a stopped rank left half-written is not one."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "rank*.jsonl"))):
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # the rank was stopped while writing it
                    continue
    return out


def _where(folder: str, ranks: int) -> dict[int, tuple[str, int]]:
    """rank -> (policy, step) it was in when the comparison ended (from its progress file)."""
    out = {}
    for r in range(ranks):
        try:
            with open(progress_path(folder, r)) as f:
                policy, step = f.read().split("\t")
            out[r] = (policy, int(step))
        except (OSError, ValueError):
            continue
    return out


def _failure(e: BaseException, folder: str, ranks: int) -> tuple[str, str, str]:
    """(policy, status, message) of a failed launch, naming the rank and the policy."""

    where = _where(folder, ranks)
    if isinstance(e, RankError):
        policy, step = where.get(e.rank, ("", -1))
        first = str(e).split("\n--- traceback")[0]
        return policy, "error", f"rank {e.rank} failed in policy {policy!r}: {first}"
    if isinstance(e, TimeoutError):
        busy = [f"rank {r} in policy {p!r} step {s + 1}" for r, (p, s) in where.items() if p]
        policy = next((p for p, _ in where.values() if p), "")
        return policy, "hung", f"{'; '.join(busy) or 'no rank had started'}: {e}"
    raise e


def _launch(w, spec, policies, job, ranks, timeout, start_method):
    """The ranks' records and the failure that ended them early (None when all ran): a rank
    that raised, died or hung, or Ctrl-C / SIGTERM here, after which launch has stopped every
    rank and all it started; the records written until then are kept either way."""

    with tempfile.TemporaryDirectory(prefix="mpnb-dist-") as folder:
        try:
            launch(
                launched,
                ranks,
                args=(spec, list(policies), job, folder),
                timeout=timeout,
                start_method=start_method,
                threads=job.get("threads"),
            )
            return _read_records(folder), None
        except (RankError, TimeoutError) as e:
            return _read_records(folder), _failure(e, folder, ranks)
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated): the ranks are gone
            label = stop_label(e)
            what = "terminated (SIGTERM)" if label == "SIGTERM" else "interrupted (Ctrl-C)"
            return _read_records(folder), ("", "interrupted", what, label)


def _interval(ms: list[float]) -> tuple[float, float, float]:
    if not ms:
        return math.nan, math.nan, math.nan
    lo, hi = median_ci(ms) if len(ms) >= 3 else (math.nan, math.nan)
    return median(ms), lo, hi


@dataclass(frozen=True)
class _Seen:
    """What the ranks' records say of one policy, and the run it was part of."""

    c: object  # the DistributedConfig
    job: dict
    w: object  # the Workload
    ranks: int
    hw: str
    ref: dict  # the single-process fp32 run (:func:`reference_run`)
    done: list  # the steps every rank finished
    losses: list  # the global batch's loss at each of them (the mean of the shards')
    timed: list  # the step times (max over ranks) past the measured steps
    measured: list  # the records of the measured steps
    meas: list  # those of the last measured step
    by_op: dict  # bytes sent per rank per step, by collective
    med: float
    lo: float
    hi: float
    metric: list
    diff: float  # max abs difference of the loss curve against single-process fp32
    status: str
    error: str


def _steps(mine: list, ranks: int) -> tuple[list, list, list]:
    """The steps every rank finished, the global loss and the timed step times (max over
    ranks) of each."""
    steps = sorted({r["step"] for r in mine})
    done = [s for s in steps if len([r for r in mine if r["step"] == s]) == ranks]
    # each rank's shard loss: their mean is the global batch's
    losses = [sum(r["loss"] for r in mine if r["step"] == s) / ranks for s in done]
    ms_by_step = [max(r["ms"] for r in mine if r["step"] == s) for s in done]
    timed = [m for s, m in zip(done, ms_by_step, strict=True) if s >= MEASURE_STEPS]
    return done, losses, timed


def _traffic(mine: list) -> tuple[list, list, dict]:
    """The measured records, those of the last measured step and their bytes by collective
    (mean over ranks)."""
    measured = [r for r in mine if "by_op" in r]
    last_measured = max((r["step"] for r in measured), default=None)
    meas = [r for r in measured if r["step"] == last_measured]
    by_op: dict[str, int] = {}
    for r in meas:
        for op, b in r["by_op"].items():
            by_op[op] = by_op.get(op, 0) + b
    return measured, meas, {op: int(round(b / max(1, len(meas)))) for op, b in by_op.items()}


def _outcome(c, done: list, failure, job: dict) -> tuple[str, str]:
    """The policy's status and error: the failure's own for the policy it names, an early
    end for one that had not finished its steps."""
    if not failure:
        return "ok", ""
    fail_policy, fail_status, fail_msg = failure[:3]
    if c.name == fail_policy:
        return fail_status, fail_msg
    if len(done) < job["steps"]:
        why = fail_msg.split(":")[0]
        return "interrupted", (
            f"the comparison ended early ({why}) after {len(done)} of {job['steps']} steps"
        )
    return "ok", ""


def _seen(c, records, failure, ref, job, w, ranks, hw) -> _Seen:
    """Everything the columns of ``c``'s row are computed from."""
    mine = [r for r in records if r["policy"] == c.name]
    done, losses, timed = _steps(mine, ranks)
    measured, meas, by_op = _traffic(mine)
    ref_l = ref["losses"][: len(losses)]
    diff = max((abs(a - b) for a, b in zip(losses, ref_l, strict=True)), default=math.nan)
    med, lo, hi = _interval(timed)
    metric = [r["metric"] for r in mine if "metric" in r]
    status, error = _outcome(c, done, failure, job)
    return _Seen(
        c=c,
        job=job,
        w=w,
        ranks=ranks,
        hw=hw,
        ref=ref,
        done=done,
        losses=losses,
        timed=timed,
        measured=measured,
        meas=meas,
        by_op=by_op,
        med=med,
        lo=lo,
        hi=hi,
        metric=metric,
        diff=diff,
        status=status,
        error=error,
    )


def _nan_unless(ok, value):
    """``value()`` when ``ok``, else ``math.nan`` (the column holds nothing measured)."""
    return value() if ok else math.nan


#: The columns every row has, skipped policies' included: (name, value of the policy and run).
_POLICY_COLUMNS = (
    ("configuration", lambda c, w, ranks: c.label()),
    ("workload", lambda c, w, ranks: w.name),
    ("ranks", lambda c, w, ranks: ranks),
    ("strategy", lambda c, w, ranks: c.strategy),
    ("policy", lambda c, w, ranks: c.name),
    ("param_dtype", lambda c, w, ranks: c.param_dtype),
    ("reduce_dtype", lambda c, w, ranks: c.reduce_dtype),
    ("tolerance", lambda c, w, ranks: c.tolerance),
)

#: The memory columns (see :func:`_mem`).
_MEM_COLUMNS = tuple(k for k in DIST_COLUMNS if k.startswith("mem_"))

#: The columns a policy that ran fills: (name, value of what was seen, :class:`_Seen`).
_RUN_COLUMNS = (
    ("precision", lambda s: s.c.precision_text()),
    ("batch_size", lambda s: s.job["global_batch"]),
    ("samples_per_step", lambda s: s.job["global_batch"]),
    ("steps", lambda s: s.job["steps"]),
    ("steps_done", lambda s: len(s.done)),
    ("optimizer", lambda s: s.job["optimizer"]),
    ("device", lambda s: s.job["device"]),
    ("hardware", lambda s: s.hw),
    ("step_time_ms", lambda s: s.med),
    ("step_time_iqr_ms", lambda s: _nan_unless(s.timed, lambda: iqr(s.timed))),
    ("timed_steps", lambda s: len(s.timed)),
    ("rounds", lambda s: len(s.timed)),
    (
        "samples_per_s",
        lambda s: _nan_unless(s.timed, lambda: s.job["global_batch"] / (s.med / 1e3)),
    ),
    ("peak_mem_mib", lambda s: _mem(s, "mem_peak_mib")),
    ("flops_per_step", lambda s: s.ref["flops_per_step"] / s.ranks),
    ("final_loss", lambda s: _nan_unless(s.losses, lambda: s.losses[-1])),
    ("metric_name", lambda s: s.w.metric_name),
    ("metric", lambda s: _nan_unless(s.metric, lambda: s.metric[0])),
    ("metric_vs_O0", lambda s: _nan_unless(s.metric, lambda: s.metric[0] - s.ref["metric"])),
    ("warnings", lambda s: ""),
    ("error", lambda s: s.error),
    ("status", lambda s: s.status),
    *((k, lambda s, k=k: _mem(s, k)) for k in _MEM_COLUMNS),
    ("bytes_sent_per_step", lambda s: _nan_unless(s.meas, lambda: sum(s.by_op.values()))),
    # ring: a rank receives what it sends
    ("bytes_recv_per_step", lambda s: _nan_unless(s.meas, lambda: sum(s.by_op.values()))),
    ("bytes_by_op", lambda s: s.by_op),
    ("comm_s", lambda s: _nan_unless(s.measured, lambda: median(_rank0_comm(s)))),
    ("step_ms", lambda s: s.med),
    ("step_ms_lo", lambda s: s.lo),
    ("step_ms_hi", lambda s: s.hi),
    ("loss_final", lambda s: _nan_unless(s.losses, lambda: s.losses[-1])),
    ("loss_vs_fp32", lambda s: s.diff),
    ("within_tolerance", lambda s: bool(s.diff <= s.c.tolerance) if s.losses else False),
)

#: The columns of a policy this device does not offer: (name, value of the policy's name in
#: ``skipped`` and the reason).
_SKIPPED_COLUMNS = (
    ("policy", lambda name, why: name),
    ("within_tolerance", lambda name, why: False),
    ("bytes_by_op", lambda name, why: {}),
    ("status", lambda name, why: "skipped"),
    ("error", lambda name, why: why),
)


def _mem(s: _Seen, k: str) -> float:
    """Memory column ``k``: the max over the ranks' records of the last measured step."""
    return max((r[k] for r in s.meas), default=math.nan)


def _rank0_comm(s: _Seen) -> list:
    """Rank 0's seconds in the collectives, one per measured step."""
    return [r["comm_s"] for r in s.measured if r["rank"] == 0]


def rows_of(records, policies, skipped, failure, ref, job, w, ranks, hw_summary="") -> pd.DataFrame:
    """One row per policy from the ranks' records (see :data:`DIST_COLUMNS`), then one per
    ``skipped`` policy; each column is one row of the tables above, a column no row fills is
    NaN."""

    rows = []
    for c in policies:
        s = _seen(c, records, failure, ref, job, w, ranks, hw_summary)
        row = {k: f(c, w, ranks) for k, f in _POLICY_COLUMNS}
        rows.append(row | {k: f(s) for k, f in _RUN_COLUMNS})
    for name, (c, why) in skipped.items():
        row = {k: f(c, w, ranks) for k, f in _POLICY_COLUMNS}
        rows.append(row | {k: f(name, why) for k, f in _SKIPPED_COLUMNS})
    cols = list(COLUMNS) + [k for k in DIST_COLUMNS if k not in COLUMNS]
    return pd.DataFrame([{k: r.get(k, math.nan) for k in cols} for r in rows], columns=cols)


def _spec(workload, w):
    """What the ranks rebuild the workload from: (name, size) for a built-in, else itself."""
    return (w.name, w.size) if isinstance(workload, str) else w


def _start_method(spec) -> str | None:
    """spawn when the workload pickles; fork (CPU) when it does not (a lambda factory)."""
    try:
        pickle.dumps(spec)
        return None
    except (pickle.PicklingError, AttributeError, TypeError):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            raise TypeError(
                "compare(ranks=N): the model factory or data do not pickle, so the ranks "
                "must be forked, and CUDA is already initialised here; define the factory "
                "with def at module level (not a lambda), or restart before any CUDA call."
            ) from None
        return "fork"


def check_limits(ranks: int, timeout, device: str) -> None:
    """Refuse, before anything runs, a ``timeout`` that bounds nothing and more CPU ranks
    than this process has CPUs (each rank would get a fraction of one, and the step times
    would measure the contention, not the policies)."""

    ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if not (ok and math.isfinite(timeout) and timeout > 0):
        raise ValueError(
            f"compare(ranks={ranks}): timeout={timeout!r} bounds nothing; give the seconds the "
            "whole distributed run may take, a positive finite number (--timeout 600)."
        )
    cpus = cpus_available()
    if not device.startswith("cuda") and ranks > cpus:
        raise ValueError(
            f"compare(ranks={ranks}): {ranks} ranks on {cpus} CPU(s) available to this process "
            "would share them (each a fraction of a CPU, their step times measuring the "
            f"contention, not the policies); pass ranks={cpus} or fewer (--ranks {cpus}), or "
            "run on a machine with more CPUs (or under torchrun across machines)."
        )


def compare_distributed(
    workload,
    w,
    *,
    ranks: int,
    strategy: str | None,
    configs,
    steps: int,
    global_batch: int,
    optimizer: str,
    lr,
    device: str,
    seed: int,
    timeout: float,
    threads: int | None = None,
) -> pd.DataFrame:
    """The distributed comparison (see :func:`mpnb.lab.compare`, ``ranks``)."""
    if ranks < 2:
        raise ValueError(f"compare: ranks={ranks} runs in one process; ranks must be >= 2 here.")
    check_limits(ranks, timeout, device)
    if global_batch % ranks:
        raise ValueError(
            f"compare(ranks={ranks}): the global batch {global_batch} does not split into "
            f"{ranks} equal shards; pass batch_sizes=({global_batch - global_batch % ranks},) "
            "or a rank count that divides it."
        )
    policies, skipped = resolve_policies(configs, strategy, device)
    job = dict(
        steps=steps,
        global_batch=global_batch,
        optimizer=optimizer,
        lr=lr,
        device=device,
        seed=seed,
        threads=threads,
    )
    with sigterm_interrupts():  # SIGTERM ends the run as Ctrl-C does: rows kept, ranks stopped
        ref = reference_run(w, job)
        spec = _spec(workload, w)
        records, failure = [], None
        if policies:
            records, failure = _launch(w, spec, policies, job, ranks, timeout, _start_method(spec))
    stopped = failure[3] if failure and len(failure) > 3 else ""
    hw = hardware_summary(device)
    df = rows_of(records, policies, skipped, failure, ref, job, w, ranks, hw["summary"])
    df.attrs["distributed"] = dict(
        ranks=ranks,
        strategy=strategy or "both",
        global_batch=global_batch,
        reference=ref["losses"],
        reference_metric=ref["metric"],
        steps=steps,
        backend="nccl" if device.startswith("cuda") else "gloo",
        failure=failure[2] if failure else "",
        method=(
            "policies round-robin on every rank (step k of each before step k+1 of any); "
            "the first 2 steps measured (memory by role, bytes at the collectives), the rest "
            "timed; step time = max over ranks"
        ),
    )
    df.attrs["hardware"] = hw
    df.attrs["workload"] = dict(name=w.name, size=w.size, description=w.description)
    df.attrs["stopped"] = bool(stopped)
    df.attrs["stopped_by"] = stopped  # "Ctrl-C", "SIGTERM" or ""
    hist = [
        dict(
            configuration=r["policy"],
            step=r["step"],
            rank=r["rank"],
            loss=r["loss"],
            step_time_ms=r["ms"],
        )
        for r in records
    ]
    df.attrs["history"] = pd.DataFrame(hist)
    return df
