"""The ``optimizers`` bench suite (``mpnb.lab.bench.optimizers``): each fused optimizer's fp32 rows
beside PyTorch's, the pure-bf16 rows, the bytes of each step and its bandwidth target."""

from __future__ import annotations

import pytest
import torch

from mpnb.lab.bench import Options, optimizers, run_case

#: B/param: update pass (param r/w 8, grad 4, fp32 states r/w 8 each) + the norm read of the
#: fp32 grads (LAMB, NovoGrad).
EXPECTED = {"SGD momentum": 20, "Adagrad": 20, "LAMB": 32, "NovoGrad": 24, "AdamW": 28}


def test_every_fused_optimizer_has_an_fp32_row_with_bytes_and_target():
    cases = [
        c
        for c in optimizers.cases(Options.make(quick=True, scale=0.0005))
        if c.name.startswith("fp32 ") and c.name.endswith(" step")
    ]
    seen = {}
    for case in cases:
        name = case.name[len("fp32 ") : -len(" step")]
        ours = [c for c in case.candidates if c.name.startswith("mpnb ")]
        assert len(ours) == 1, case.name
        n = case.bandwidth_numel
        assert all(c.bytes == EXPECTED[name] * n for c in case.candidates if not c.compiled)
        if case.workload.startswith("(a)"):
            assert ours[0].bw_target is not None and ours[0].bw_target >= 0.7, case.name
        ours[0].fn()  # the step runs
        seen.setdefault(name, set()).add(case.workload)
    assert set(seen) == set(EXPECTED)
    assert all(len(w) == len(optimizers.WORKLOADS) for w in seen.values())


def test_every_bandwidth_target_has_a_one_thread_roofline_below_the_serial_size(monkeypatch):
    # The rows held to a share of the bandwidth carry their step on cache-resident params
    # (half of an 8 MiB last-level cache here) and on a sixteenth of them, both below the
    # size at which the multi-tensor ops go parallel (so one core's, scaled by the threads).
    monkeypatch.setattr(optimizers, "llc_bytes", lambda: 8 << 20)
    checked = 0
    for case in optimizers.cases(Options.make(quick=True, scale=0.0005)):
        for c in case.candidates:
            if c.bw_target is None:
                continue
            ic = c.in_cache
            assert ic is not None and ic.one_thread, (case.name, c.name)
            bpp = c.bytes // case.bandwidth_numel
            assert ic.bytes // bpp < optimizers.SERIAL_ELEMS and ic.bytes <= 4 << 20
            assert ic.small_bytes * 10 < ic.bytes
            ic.fn(), ic.small_fn()  # both steps run
            checked += 1
    assert checked >= 12  # fp32 AdamW, 5 O2 steps, 4 fp32 steps, 2 pure-bf16 steps
    monkeypatch.setattr(optimizers, "llc_bytes", lambda: None)
    assert optimizers._in_cache(lambda ns: None, 28) is None  # no guessed cache


def test_the_serial_size_is_the_kernels_own():
    from pathlib import Path

    header = Path(__file__).resolve().parents[3] / "csrc" / "cpu" / "multi_tensor_apply.h"
    assert "constexpr int64_t kSerialElems = 1 << 17;" in header.read_text()
    assert optimizers.SERIAL_ELEMS == 1 << 17


def test_lamb_counts_its_second_pass_over_tensors_beyond_the_cache(monkeypatch):
    # LAMB's trust ratio needs a tensor's whole update norm before any weight is written: the
    # params of a tensor beyond what the last-level cache holds of w and u (8 B each) are
    # streamed twice, +12 B each; the GPT's embedding alone with an 8 MiB L3.
    monkeypatch.setattr(optimizers, "llc_bytes", lambda: 8 << 20)
    gpt = optimizers.WORKLOADS["(a) GPT 20M/76"]()
    emb = max(gpt)
    assert optimizers.lamb_second_pass(gpt) == 12 * (emb - (1 << 20))
    assert optimizers.lamb_second_pass([1 << 20, 1000]) == 0
    monkeypatch.setattr(optimizers, "llc_bytes", lambda: None)
    assert optimizers.lamb_second_pass(gpt) == 0  # unknown cache: the one-pass count

    # In the rows: a 16 KiB cache holds w and u of 2048 params; LAMB's rows (fp32 and O2,
    # every candidate) add the second pass of the larger tensors, the other optimizers do not.
    monkeypatch.setattr(optimizers, "llc_bytes", lambda: 16 << 10)
    opts = Options.make(quick=True, scale=0.0005)
    per_param = {"fp32 LAMB step": 32, "O2 LAMB step": 28 + optimizers.PREPASS}
    seen = set()
    for case in optimizers.cases(opts):
        n = case.bandwidth_numel
        if case.name in per_param:
            numels = [max(1, round(k * opts.scale)) for k in optimizers.WORKLOADS[case.workload]()]
            second = 12 * sum(max(0, k - 2048) for k in numels)
            assert second > 0 or case.workload.startswith("(d)")
            assert all(c.bytes == per_param[case.name] * n + second for c in case.candidates)
            seen.add((case.name, case.workload))
        elif case.name.endswith(" step") and "pure-bf16" not in case.name:
            assert all(c.bytes % n == 0 for c in case.candidates), case.name
    assert len(seen) == 2 * len(optimizers.WORKLOADS)


def _fixed_times(monkeypatch, per_round: dict[str, list[float]]):
    """Make run_case see these per-round times (seconds per call) instead of a clock's."""
    from mpnb.lab.bench import _harness

    def fake(cands, opts):
        times = [list(per_round[c.name][: opts.rounds]) for c in cands]
        return times, [1] * len(cands), [0.0] * len(cands)

    monkeypatch.setattr(_harness, "time_rounds", fake)


def test_pure_bf16_rows_report_bytes_and_bandwidth_share(monkeypatch):
    from mpnb.lab.bench import optimizers

    monkeypatch.setattr(optimizers, "llc_bytes", lambda: 8 << 20)  # the rooflines' slices
    case = next(
        c
        for c in optimizers.cases(Options.make(quick=True, scale=0.0005))
        if c.name == "pure-bf16 AdamW step"
    )
    eager = [c for c in case.candidates if not c.compiled]  # --quick leaves out the compiled
    for cand in eager:
        cand.fn()  # every step runs (the fixed times below replace only the clock)
    n = case.bandwidth_numel
    per_param = [c.bytes // n for c in eager]
    assert per_param == [14, 22, 22, 26]
    names = [c.name for c in eager]
    bw = "bw: a += s*b (fp32)"
    times = {names[0]: [1e-3], names[1]: [2e-3], names[2]: [2e-3], names[3]: [3e-3], bw: [1e-3]}
    for c in eager[1:]:  # each of ours has its in-cache roofline: 0.1 ms more for the slice
        times |= {f"{c.name} [in cache]": [3e-4], f"{c.name} [in cache, small]": [2e-4]}
    _fixed_times(monkeypatch, times)
    rows = run_case(case, Options.make(quick=True, rounds=1))
    nearest, sr, kahan = rows[1], rows[2], rows[3]
    # bandwidth a += s*b moves 12 B/elem in 1 ms; SR moves 22 B/param in 2 ms: 22/24 of it
    assert nearest.bw_frac == pytest.approx(22 / 24) and nearest.status == "PASS"
    assert sr.bw_frac == pytest.approx(22 / 24) and sr.status == "PASS"
    assert kahan.bw_frac == pytest.approx(26 / 36) and kahan.status == "MISS"
    assert rows[-1].role == "bandwidth"
    for row, c in zip((nearest, sr, kahan), eager[1:], strict=True):
        ic = c.in_cache  # one core's slices, so the run's threads multiply their throughput
        want = torch.get_num_threads() * (ic.bytes - ic.small_bytes) / 1e-4 / 1e9
        assert row.cache_gbps == pytest.approx(want) and row.bound in ("compute", "memory")
    assert rows[0].cache_gbps is None  # PyTorch's step: no bandwidth target
