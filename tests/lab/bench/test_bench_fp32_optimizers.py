"""The optimizers suite's fp32 rows (no master weights): each fused optimizer beside PyTorch's,
with the least bytes of its step and the 70%-of-bandwidth target on the large workload."""

from __future__ import annotations

from mpnb.lab.bench import optimizers
from mpnb.lab.bench._harness import Options

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
