"""``mpnb.lab.profile`` (``mpnb.lab.profiling``): per-phase and per-module times, FLOPs and the
op table of one step per level, a failing level named apart, the chrome trace."""

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import mpnb.lab
from mpnb.lab.profiling import PHASES


def test_profile_phases_modules_flops_ops():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    r = mpnb.lab.profile(
        model,
        torch.randn(16, 32),
        opt_levels=("O0", "O1", "O2"),
        half_dtype="bf16",
        steps=2,
        warmup=1,
    )
    assert r.errors == {}
    assert set(r.phases.phase) == set(PHASES) and (r.phases.time_ms >= 0).all()
    o1 = r.modules[r.modules.opt_level == "O1"].set_index("module")
    assert o1.loc["0", "output_dtype"] == "bfloat16" and o1.loc["1", "type"] == "ReLU"
    o0 = r.modules[r.modules.opt_level == "O0"].set_index("module")
    assert o0.loc["0", "output_dtype"] == "float32"
    # 2*m*n*k per matmul: forward and weight grads of both Linears, and the input grad of
    # the second only (the model's input needs no grad)
    mm = 2 * 16 * (32 * 64 + 64 * 8)
    assert (r.flops.flops == 2 * mm + 2 * 16 * 64 * 8).all()
    assert (r.flops.flop_per_s > 0).all()
    assert len(r.ops) and r.ops.self_cpu_ms.ge(0).all()
    assert next(model.parameters()).dtype == torch.float32


class _NoHalf(nn.Module):
    """Refuses half weights: O2 (bf16 weights) fails, O0 and O1 (fp32 weights) run."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        if self.lin.weight.dtype != torch.float32:
            raise RuntimeError("no half weights here")
        return self.lin(x)


def test_a_failing_level_is_named_and_the_others_are_kept():
    model = _NoHalf()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = mpnb.lab.profile(
        model, torch.randn(4, 8), opt_levels=("O0", "O2"), half_dtype="bf16", steps=1, warmup=1
    )
    assert list(r.errors) == ["O2"] and "no half weights here" in r.errors["O2"]
    assert set(r.phases.opt_level) == set(r.flops.opt_level) == {"O0"}
    assert r.device == "cpu" and r.half_dtype == torch.bfloat16
    assert r.memory is None and r.overflow is None and r.precision is None  # not asked for
    after = model.state_dict()  # each level trains a copy: yours is left as it was
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_chrome_trace_of_a_profiled_level(tmp_path):
    import json

    r = mpnb.lab.profile(
        nn.Linear(8, 4), torch.randn(4, 8), opt_levels=("O0", "O1"), steps=1, warmup=1
    )
    path = r.export_chrome_trace(str(tmp_path / "o1.json"), "O1")
    assert json.loads(Path(path).read_text())["traceEvents"]
    with pytest.raises(ValueError, match="'O2' was not profiled"):
        r.export_chrome_trace(str(tmp_path / "o2.json"), "O2")
    r.traces.clear()
    with pytest.raises(RuntimeError, match="no level was profiled"):
        r.export_chrome_trace(str(tmp_path / "none.json"))


def test_more_threads_than_cpus_warns():
    n = (os.cpu_count() or 1) + 1
    with pytest.warns(UserWarning, match=f"threads={n}"):
        r = mpnb.lab.profile(
            nn.Linear(8, 4), torch.randn(4, 8), opt_levels=("O0",), steps=1, warmup=1, threads=n
        )
    assert r.errors == {}
