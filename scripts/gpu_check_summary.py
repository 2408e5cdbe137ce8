"""The GPU check's summary (``scripts/gpu_check.py``): Markdown tables from the runs' JSON files.

Everything here reads files the check's steps wrote under its output directory and measures
nothing; a file that is missing (its step failed or overran) gives a line that says so, never a
number. Tables:

* the steps (budget, time taken, result, the last log line of a failure);
* the Triton kernels' decisions (``measured.json`` with this run pooled in: the worst case's
  ratio and 95% interval), then every case of ``mpnb bench --device cuda`` (PyTorch's time,
  mpnb's, the ratio and its interval, the share of the same-run copy bandwidth) and the
  kernel targets (every kernel at least 1.0x, the interval's lower end included; the
  multi-tensor L2 norm and scale at least 1.0x; norms and softmax at 75% or more of the copy
  bandwidth at the large size; the O2 step at least 1.5x torch's path, lower end included);
* the list launchers' host cost per call (``mpnb bench host-cost``): torch's call, the launcher
  with its chunk table cached, the whole op through the dispatcher, the dispatcher's floor;
* the GPU-sized workload: every row's speed vs O0 and vs torch-amp in its half dtype, step time,
  GPU busy, host syncs per step, and the estimate of :mod:`mpnb.lab.gpu_estimate` from the row's
  own counts (measured / estimated), then the targets (O2 bf16 at least 1.5x O0 and 0.97x
  torch-amp; every estimate within 1.5x) and the run's verdict;
* host reads and CUDA synchronizations per step (``python -m mpnb.lab.sync_count``);
* the FP8 recipes against bf16 by Linear size (``mpnb bench fp8``);
* the speed a CPU run's verdict estimates for this card beside the speed measured on it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

__all__ = [
    "summary",
    "targets",
    "kernel_targets",
    "workload_rows",
    "estimate_vs_measured",
    "read_json",
]

#: O2 bf16 must reach these on the GPU workload (issue: "a GPU workload the GPU computes")
O2_VS_O0, O2_VS_TORCH_AMP, ESTIMATE_WITHIN = 1.5, 0.97, 1.5
#: the kernels' targets: the O2 step's speed-up over torch's path, and the share of the copy
#: bandwidth the norms and softmax reach at the large size
O2_STEP_VS_TORCH, LAYER_BW_AT_LARGE = 1.5, 0.75
_MULTI_TENSOR = ("multi_tensor_l2norm", "multi_tensor_scale")
_LAYERS = ("layer_norm", "rms_norm", "softmax")


def read_json(path: Path) -> dict:
    """The JSON document at ``path``, or ``{}`` when it is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _f(v, fmt="{:.2f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def _num(r: dict, key: str) -> float:
    v = r.get(key)
    return float(v) if isinstance(v, (int, float)) else math.nan


def _peer_ms(rows: list[dict]) -> dict:
    """torch-amp's median step time per (half dtype, batch size)."""
    return {
        (r.get("half_dtype"), r.get("batch_size")): _num(r, "step_time_ms")
        for r in rows
        if r.get("opt_level") == "torch-amp" and r.get("status") == "ok"
    }


def workload_rows(rows: list[dict], card: str) -> list[dict]:
    """Per row of the GPU workload's compare: the measured figures beside the estimate the
    lab's model makes from the row's own counts (FLOPs, bytes, ops, host syncs)."""
    import pandas as pd

    from mpnb.lab.gpu_estimate import estimate_for_card

    ok = [r for r in rows if r.get("status") == "ok"]
    est = {}
    if ok:
        for _, e in estimate_for_card(pd.DataFrame(ok), card).iterrows():
            est[e["configuration"]] = e
    peer = _peer_ms(rows)
    out = []
    for r in rows:
        e = est.get(r.get("configuration"))
        measured = _num(r, "speedup_vs_O0")
        guess = float(e["est_speedup_vs_O0"]) if e is not None else math.nan
        ref = peer.get((r.get("half_dtype"), r.get("batch_size")), math.nan)
        out.append(
            dict(
                configuration=r.get("configuration", "?"),
                precision=r.get("precision", ""),
                status=r.get("status", ""),
                measured=measured,
                lo=_num(r, "speedup_lo"),
                hi=_num(r, "speedup_hi"),
                vs_torch_amp=ref / _num(r, "step_time_ms"),
                step_ms=_num(r, "step_time_ms"),
                busy=_num(r, "gpu_busy"),
                syncs=_num(r, "host_syncs_per_step"),
                estimated=guess,
                error=measured / guess if guess > 0 else math.nan,
                bound=e["bound"] if e is not None else "",
            )
        )
    return out


def targets(table: list[dict]) -> list[str]:
    """The issue's targets on the GPU workload, each PASS, MISS or "not measured"."""
    o2 = next((r for r in table if r["configuration"].startswith("O2 bf16 b")), None)
    lines = []
    if o2 is None or not math.isfinite(o2["measured"]):
        return ["- O2 bf16 on the GPU workload: not measured (see the compare step)."]
    ok = o2["lo"] >= O2_VS_O0
    lines.append(
        f"- O2 bf16 >= {O2_VS_O0}x O0: {'PASS' if ok else 'MISS'} ({_f(o2['measured'])}x, "
        f"95% {_f(o2['lo'])}-{_f(o2['hi'])})"
    )
    v = o2["vs_torch_amp"]
    verdict = "not measured" if not math.isfinite(v) else "PASS" if v >= O2_VS_TORCH_AMP else "MISS"
    lines.append(f"- O2 bf16 >= {O2_VS_TORCH_AMP}x torch-amp bf16: {verdict} ({_f(v)}x, medians)")
    errs = [r["error"] for r in table if math.isfinite(r["error"])]
    within = [1 / ESTIMATE_WITHIN <= e <= ESTIMATE_WITHIN for e in errs]
    lines.append(
        f"- estimate within {ESTIMATE_WITHIN}x on every row: "
        + (
            f"{'PASS' if all(within) else 'MISS'} ({sum(within)} of {len(errs)} rows)"
            if errs
            else "no rows"
        )
    )
    return lines


def _bf16_twin(configuration: str, card: str) -> str:
    """An fp16 configuration takes its bf16 twin's estimate where the card's fp16 and bf16 peaks
    are equal (the CPU runs bf16, its default)."""
    from mpnb.lab.gpu_estimate import GPU_PEAKS, card_key

    key = card_key(card)
    same = key is not None and GPU_PEAKS[key]["fp16"] == GPU_PEAKS[key]["bf16"]
    return configuration.replace(" fp16 ", " bf16 ") if same else ""


def estimate_vs_measured(cuda_rows: list[dict], cpu_runs: list[list[dict]], card: str):
    """Per configuration: the speed vs O0 measured on ``card`` and the one a CPU run's verdict
    estimates for it (:func:`mpnb.lab.gpu_estimate.estimate_for_card`), and their ratio."""
    import pandas as pd

    from mpnb.lab.gpu_estimate import estimate_for_card

    est = {}
    for rows in cpu_runs:
        if rows:
            for _, e in estimate_for_card(pd.DataFrame(rows), card).iterrows():
                est.setdefault(e["configuration"], e)
    out = []
    for r in cuda_rows:
        e = est.get(r["configuration"], est.get(_bf16_twin(r["configuration"], card)))
        measured = r.get("speedup_vs_O0")
        guess = float(e["est_speedup_vs_O0"]) if e is not None else math.nan
        ok = measured is not None and math.isfinite(measured) and math.isfinite(guess)
        out.append(
            dict(
                configuration=r["configuration"],
                precision=r.get("precision", ""),
                measured=measured,
                estimated=guess,
                error=measured / guess if ok and guess > 0 else math.nan,
                bound=e["bound"] if e is not None else "",
            )
        )
    return out


def _off(error: float) -> str:
    bad = math.isfinite(error) and not 1 / ESTIMATE_WITHIN <= error <= ESTIMATE_WITHIN
    return f" (off by more than {ESTIMATE_WITHIN}x)" if bad else ""


def _steps_table(results, limit_s: int) -> list[str]:
    total = sum(r.seconds for r in results)
    lines = [f"Total {total:.0f} s (limit {limit_s} s).", ""]
    lines += ["| step | budget s | took s | result | checks |", "|---|---|---|---|---|"]
    for r in results:
        note = f" (`{r.log.name}`: {r.tail[-1][:120]})" if r.status != "pass" and r.tail else ""
        lines.append(
            f"| {r.step.name} | {r.step.budget_s} | {r.seconds:.0f} | {r.status}{note} "
            f"| {r.step.what} |"
        )
    return lines


def _triton_table(triton: dict) -> list[str]:
    from mpnb.core.ops.triton import LAUNCHERS
    from mpnb.core.ops.triton._decision import decide

    lines = ["", "## Triton kernels vs PyTorch's CUDA path (`mpnb bench --device cuda`)"]
    lines += [
        "",
        "| kernel | worst case: PyTorch time / Triton time (95%) | runs pooled | decision |",
    ]
    lines.append("|---|---|---|---|")
    for name in LAUNCHERS:
        d = decide(name, triton)
        runs = triton.get("kernels", {}).get(name, {}).get("runs", "-")
        ratio = f"{_f(d.speed_vs_torch)} ({_f(d.speed_lo)}-{_f(d.speed_hi)})"
        lines.append(f"| {name} | {ratio} | {runs} | {d.label.split(':')[0]} |")
    return lines


def _op(row: dict) -> str:
    """The Triton kernel a bench row times ("" for a baseline, the copy, the O2 step)."""
    name = str(row.get("candidate", ""))
    return name.split()[1] if row.get("role") == "candidate" and name[:7] == "triton " else ""


def kernel_targets(rows: list[dict]) -> list[str]:
    """The kernel targets from the bench's rows, each PASS, MISS or "not measured"."""
    lo: dict[str, float] = {}
    for r in rows:
        if _op(r) and isinstance(r.get("ratio_lo"), (int, float)):
            lo[_op(r)] = min(lo.get(_op(r), math.inf), float(r["ratio_lo"]))
    if not lo:
        return ["- the kernel targets: not measured (see the bench cuda step)."]
    below = sorted(op for op, v in lo.items() if v < 1.0)
    verdict = "PASS" if not below else f"MISS (below: {', '.join(below)})"
    lines = [f"- every kernel >= 1.0x PyTorch, lower end included: {verdict} ({len(lo)} measured)"]
    mt = {op: lo[op] for op in _MULTI_TENSOR if op in lo}
    lines.append(
        "- multi-tensor l2norm and scale >= 1.0x: "
        + (
            ("PASS" if all(v >= 1.0 for v in mt.values()) else "MISS")
            + " ("
            + ", ".join(f"{op} {_f(v)}" for op, v in mt.items())
            + ", lower ends)"
            if mt
            else "not measured"
        )
    )
    large = [
        r
        for r in rows
        if any(k in _op(r) for k in _LAYERS) and str(r.get("workload", "")).startswith("(L) ")
    ]
    shares = [_num(r, "bw_frac") for r in large]
    ok = all(math.isfinite(v) and v >= LAYER_BW_AT_LARGE for v in shares)
    lines.append(
        f"- norms and softmax >= {LAYER_BW_AT_LARGE:.0%} of copy bandwidth at the large size: "
        + (
            f"{'PASS' if ok else 'MISS'} (lowest {min(shares):.0%} of {len(shares)} cases)"
            if shares
            else "not measured (skipped or failed: see the bench's log)"
        )
    )
    step = [r for r in rows if str(r.get("case", "")).startswith("O2 step")]
    step = [r for r in step if r.get("role") == "candidate"]
    for r in step:
        lo_, ok = _num(r, "ratio_lo"), _num(r, "ratio_lo") >= O2_STEP_VS_TORCH
        lines.append(
            f"- {r['case']} [{r['workload']}] >= {O2_STEP_VS_TORCH}x torch's path: "
            f"{'PASS' if ok else 'MISS'} ({_f(_num(r, 'ratio'))}x, 95% {_f(lo_)}-"
            f"{_f(_num(r, 'ratio_hi'))})"
        )
    return lines


def _bench_table(doc: dict) -> list[str]:
    rows = doc.get("rows", [])
    lines = ["", "## Every case of `mpnb bench --device cuda`", ""]
    if not rows:
        return lines + ["(no rows: see the bench cuda step's log)"]
    if doc.get("header", {}).get("quick"):
        lines += ["A `--quick` run: one short measurement per case, not recorded.", ""]
    if doc.get("header", {}).get("stopped"):
        lines += [
            f"Stopped by its time budget ({doc['header']['stopped']}): later cases are missing.",
            "",
        ]
    base = {(r.get("case"), r.get("workload")): r for r in rows if r.get("role") == "baseline"}
    lines += [
        "| case | PyTorch | ms | mpnb | ms | PyTorch / mpnb (95%) | rounds | % copy bw |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("status") == "SKIPPED" and r.get("role") == "baseline":
            lines.append(f"| {r['case']} [{r['workload']}] | skipped: {r.get('error', '')} |||||||")
        if r.get("role") != "candidate" or r.get("status") == "SKIPPED":
            continue
        b = base.get((r.get("case"), r.get("workload")), {})
        lines.append(
            f"| {r['case']} [{r['workload']}] | {b.get('candidate', '?')} "
            f"| {_f(_num(b, 'median_s') * 1e3, '{:.3f}')} | {r['candidate']} "
            f"| {_f(_num(r, 'median_s') * 1e3, '{:.3f}')} | {_f(_num(r, 'ratio'))} "
            f"({_f(_num(r, 'ratio_lo'))}-{_f(_num(r, 'ratio_hi'))}) | {r.get('rounds', '-')} "
            f"| {_f(_num(r, 'bw_frac'), '{:.0%}')} |"
        )
    return lines + ["", "Targets:", "", *kernel_targets(rows)]


def _workload_table(doc: dict, card: str) -> list[str]:
    rows = doc.get("rows", [])
    lines = ["", f"## The GPU-sized workload on {card} (`mpnb compare --size auto`)", ""]
    if not rows:
        return lines + ["(no rows: see the compare step's log)"]
    w = doc.get("workload", {})
    lines += [f"Workload: {w.get('description', '?')} ({w.get('size', '?')}).", ""]
    lines.append(
        "| configuration | precision | speed vs O0 (95%) | vs torch-amp | step ms | GPU busy "
        "| host syncs/step | estimated | measured / estimated | estimate's bound |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    table = workload_rows(rows, card)
    for r in table:
        if r["status"] != "ok":
            lines.append(f"| {r['configuration']} | {r['precision']} | {r['status']} |||||||| ")
            continue
        speed = f"{_f(r['measured'])} ({_f(r['lo'])}-{_f(r['hi'])})"
        lines.append(
            f"| {r['configuration']} | {r['precision']} | {speed} | {_f(r['vs_torch_amp'])} "
            f"| {_f(r['step_ms'], '{:.1f}')} | {_f(r['busy'], '{:.0%}')} "
            f"| {_f(r['syncs'], '{:.0f}')} | {_f(r['estimated'])} "
            f"| {_f(r['error'])}{_off(r['error'])} | {r['bound']} |"
        )
    lines += ["", "Targets:", "", *targets(table)]
    text = doc.get("verdict", {}).get("text", "")
    if text:
        lines += ["", "The run's verdict:", "", "```", text, "```"]
    return lines


def _syncs_table(doc: dict) -> list[str]:
    lines = ["", "## Host reads and CUDA synchronizations per step (`mpnb.lab.sync_count`)", ""]
    rows = doc.get("rows", [])
    if not rows:
        return lines + ["(no rows: see the syncs step's log)"]
    lines += ["| way to train | host reads/step | CUDA syncs/step |", "|---|---|---|"]
    for r in rows:
        err = f" ERROR {r['error'][:80]}" if "error" in r else ""
        lines.append(
            f"| {r['name']} | {_f(_num(r, 'host_reads'))} | {_f(_num(r, 'cuda_syncs'))}{err} |"
        )
    return lines


def _fp8_table(doc: dict) -> list[str]:
    lines = ["", "## FP8 recipes vs bf16 by Linear size (`mpnb bench fp8`)", ""]
    rows = doc.get("rows", [])
    if not rows:
        return lines + ["(no rows: see the fp8 step's log)"]
    lines += ["| shape | recipe | ms | bf16 time / recipe time (95%) | TFLOP/s | GEMMs |"]
    lines.append("|---|---|---|---|---|---|")
    for r in rows:
        lines.append(
            f"| {r.get('case', '?')} | {r.get('candidate', '?')} | {_f(_num(r, 'median_s') * 1e3)} "
            f"| {_f(_num(r, 'ratio'))} ({_f(_num(r, 'ratio_lo'))}-{_f(_num(r, 'ratio_hi'))}) "
            f"| {_f(_num(r, 'tflops'), '{:.1f}')} | {r.get('note', '')} |"
        )
    return lines + ["", *[f"- {s}" for s in doc.get("summary", [])]]


def _host_cost_table(doc: dict) -> list[str]:
    """The list launchers' host cost per call beside torch's (``mpnb bench host-cost``): one
    line per op and list, torch's call, mpnb's launcher (table cached), the whole op through
    the dispatcher, and the dispatcher's floor (a no-op Python kernel on the same lists)."""
    lines = ["", "## Host cost per call of the list launchers (`mpnb bench host-cost`)", ""]
    rows = doc.get("rows", [])
    if not rows:
        return lines + ["(no rows: see the bench host-cost step's log)"]
    by: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        name = r.get("candidate", "")
        kind = (
            "torch"
            if r.get("role") == "baseline"
            else "cached"
            if name.endswith("table cached")
            else "op"
            if name.endswith("(wrapper, dispatcher, launcher)")
            else "floor"
            if name.startswith("dispatcher floor")
            else None
        )
        if kind:
            by.setdefault((r.get("case"), r.get("workload")), {})[kind] = r

    def us(r: dict | None) -> str:
        return _f(_num(r or {}, "median_s") * 1e6, "{:.1f}")

    def vs(r: dict | None) -> str:
        if not r:
            return "-"
        return f"{_f(_num(r, 'ratio'))}x {r.get('status') or ''}".rstrip()

    lines += [
        "torch's time / mpnb's (at least 1.0: mpnb costs the host no more than torch's call).",
        "",
        "| case | torch's call, us | launcher (table cached), us | vs torch | op via the "
        "dispatcher, us | vs torch | dispatcher floor, us |",
        "|---|---|---|---|---|---|---|",
    ]
    for (case, work), got in by.items():
        lines.append(
            f"| {case} [{work}] | {us(got.get('torch'))} | {us(got.get('cached'))} "
            f"| {vs(got.get('cached'))} | {us(got.get('op'))} | {vs(got.get('op'))} "
            f"| {us(got.get('floor'))} |"
        )
    return lines


def _estimate_table(out: Path, card: str) -> list[str]:
    cuda = read_json(out / "compare-medium-cuda.json").get("rows", [])
    cpu = read_json(out / "compare-cpu-medium.json").get("rows", [])
    rows = estimate_vs_measured(cuda, [cpu], card)
    lines = ["", f"## Speed vs O0 at size medium: measured on {card}, estimated by a CPU run", ""]
    lines.append(
        "| configuration | precision | measured | estimated | measured / estimated "
        "| estimate's bound |"
    )
    lines.append("|---|---|---|---|---|---|")
    for r in rows:
        lines.append(
            f"| {r['configuration']} | {r['precision']} | {_f(r['measured'])} | "
            f"{_f(r['estimated'])} | {_f(r['error'])}{_off(r['error'])} | {r['bound']} |"
        )
    if not rows:
        lines.append("| (no CUDA rows at size medium: see its step) | | | | | |")
    return lines


def summary(results, out: Path, card: str, about: str, triton: dict, limit_s: int) -> str:
    """The whole summary as Markdown (see the module docstring)."""
    lines = [f"# GPU check: {card}", "", about, *_steps_table(results, limit_s)]
    lines += _triton_table(triton)
    lines += _bench_table(read_json(out / "bench-cuda.json"))
    lines += _host_cost_table(read_json(out / "bench-host-cost.json"))
    lines += _workload_table(read_json(out / "compare-gpu.json"), card)
    lines += _syncs_table(read_json(out / "syncs.json"))
    lines += _fp8_table(read_json(out / "bench-fp8.json"))
    lines += _estimate_table(out, card)
    return "\n".join(lines) + "\n"


def slug(card: str) -> str:
    """A file-name form of a card's name."""
    return re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-")
