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
