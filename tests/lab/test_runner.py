"""``mpnb.lab.compare``: every column for every opt level and dtype, error rows, the scaler."""

import dataclasses
import inspect
import math
import time
from dataclasses import fields, replace

import pandas as pd
import pytest
import torch
from torch import nn

import mpnb.lab
from mpnb.lab import (
    ConfigsPlan,
    DistributedPlan,
    OutputPlan,
    Plan,
    TimingPlan,
    WorkloadPlan,
    workloads,
)
from mpnb.lab.config import expand
from mpnb.lab.runner import COLUMNS
from mpnb.lab.verdict import TOLERANCE


def _data(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return x, (x[:, :4].argmax(1))


def _tiny():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _tiny_workload(model_fn=_tiny, **kw):
    return workloads.custom(
        model_fn,
        _data(),
        nn.functional.cross_entropy,
        workloads.accuracy,
        eval_data=_data(128, 1),
        metric_name="accuracy",
        lr=1e-2,
        batch_size=16,
        **kw,
    )


def test_every_column_for_every_level_bf16_and_fp16():
    # SGD: pure-fp16 Adam (O3) diverges here, which the next tests cover as an error row.
    df = mpnb.lab.compare(
        _tiny_workload(),
        half_dtype=("bf16", "fp16"),
        steps=8,
        optimizer="sgd",
        progress=False,
        threads=1,
    )
    assert list(df.columns) == list(COLUMNS)
    assert sorted(df.configuration) == sorted(
        [
            "O0 fp32 b16",
            "O1 bf16 b16",
            "O2 bf16 b16",
            "O3 bf16 b16",
            "O1 fp16 b16",
            "O2 fp16 b16",
            "O3 fp16 b16",
            "torch-amp bf16 b16",  # the peer runs by default, once per half dtype
            "torch-amp fp16 b16",
        ]
    )
    assert (df.error == "").all(), df.error.tolist()
    numeric = [c for c in COLUMNS if c.endswith(("_ms", "_mib", "_s", "_O0", "loss", "metric"))]
    numeric.remove("compile_s")  # nothing here compiles: NaN, never 0
    numeric.remove("gpu_kernel_ms")  # a CPU run: no GPU busy figure, NaN, never made up
    for c in numeric:
        assert df[c].notna().all(), c
    assert df.gpu_busy.isna().all() and df.gpu_kernel_ms.isna().all()
    o0 = df[df.opt_level == "O0"].iloc[0]
    assert o0.speedup_vs_O0 == pytest.approx(1.0) and o0.output_diff_vs_O0 == 0
    assert (df[df.opt_level != "O0"].output_diff_vs_O0 > 0).all()
    assert df.precision[df.half_dtype == "fp16"].str.startswith("fp16").all()
    hist = df.attrs["history"]
    assert set(hist.configuration) == set(df.configuration)
    assert (hist.groupby("configuration").size() == 8).all()
    assert set(hist.phase) == {"warmup", "timed", "memory"}
    o2 = df[df.configuration == "O2 bf16 b16"].iloc[0]
    assert o2.mem_master_weights_mib > 0 and o2.mem_params_mib < o0.mem_params_mib
    assert df.attrs["hardware"]["bf16"] in ("native", "emulated", "unsupported")


class _Fragile(nn.Module):
    """Fails in half precision: stands for user code that breaks under O2/O3."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        if self.lin.weight.dtype != torch.float32:
            raise RuntimeError("planted failure: this layer needs fp32 weights")
        return self.lin(x)


def test_failing_configuration_is_an_error_row_and_others_run():
    w = workloads.custom(
        _Fragile,
        _data(),
        nn.functional.cross_entropy,
        workloads.accuracy,
        metric_name="accuracy",
        batch_size=16,
    )
    df = mpnb.lab.compare(w, steps=5, progress=False, threads=1).set_index("opt_level")
    assert df.loc["O0", "error"] == "" and df.loc["O1", "error"] == ""
    for lvl in ("O2", "O3"):
        assert "planted failure" in df.loc[lvl, "error"]
        assert "RuntimeError" in df.loc[lvl, "error"]
    assert math.isfinite(df.loc["O1", "metric"]) and math.isfinite(df.loc["O1", "speedup_vs_O0"])


def test_nan_divergence_is_an_error_row_with_its_history():
    calls = {"n": 0}

    def loss_fn(out, y):
        calls["n"] += 1
        loss = nn.functional.cross_entropy(out, y)
        return loss * float("nan") if calls["n"] == 4 else loss

    w = workloads.custom(_tiny, _data(), loss_fn, batch_size=16)
    df = mpnb.lab.compare(w, opt_levels=("O0",), steps=8, progress=False, threads=1)
    assert "NaN divergence" in df.error[0] and "step 3" in df.error[0]
    assert "loss scal" not in df.error[0]  # fp32 diverged: no loss-scaling advice
    assert len(df.attrs["history"]) == 4  # the steps before the failure are kept


def test_loss_scale_dict_history_records_skipped_steps():
    df = mpnb.lab.compare(
        _tiny_workload(),
        opt_levels=("O0", "O2"),
        half_dtype="fp16",
        steps=10,
        progress=False,
        threads=1,
        loss_scale=dict(
            init_scale=2.0**24, growth_factor=2.0, backoff_factor=0.125, growth_interval=1000
        ),
    )
    row = df.set_index("opt_level").loc["O2"]
    assert row.error == "" and row.skipped_steps >= 1
    hist = df.attrs["history"]
    h = hist[hist.configuration == row.configuration]
    assert h.loss_scale.iloc[0] == 2.0**24 * 0.125  # one backoff by the custom factor
    assert (h[h.skipped].skip_reason != "").all()
    assert row.final_loss_scale < 2.0**24


def test_bad_requests_raise_before_running():
    with pytest.raises(ValueError, match="O4"):
        expand("mlp", ("O0", "O4"))
    with pytest.raises(ValueError, match="half_dtype"):
        expand("mlp", half_dtype="fp8")
    with pytest.raises(ValueError, match="loss_scale"):
        expand("mlp", loss_scale=dict(init=1.0))
    with pytest.raises(ValueError, match="unknown"):
        mpnb.lab.compare("resnet50", progress=False)
    with pytest.raises(TypeError, match="model_fn"):
        workloads.custom(_tiny(), _data(), nn.functional.cross_entropy)


@pytest.mark.slow
def test_isolate_runs_each_configuration_in_a_subprocess():
    df = mpnb.lab.compare(
        "mlp", opt_levels=("O0",), steps=4, progress=False, threads=1, isolate=True
    )  # one subprocess: each pays for importing torch
    assert (df.error == "").all(), df.error.tolist()
    assert df.attrs["method"] == "isolated subprocesses"
    assert df.metric.notna().all() and len(df.attrs["history"]) == 4


# ---- Plan: compare's request as one value ------------------------------------------------------


def _plan(**configs):
    return Plan(
        WorkloadPlan(_tiny_workload(), steps=4),
        ConfigsPlan(("O0", "O2"), half_dtype="bf16", optimizer="sgd", **configs),
        TimingPlan(threads=1),
        OutputPlan(progress=False),
    )


# the columns a run fills the same from the same seed (the step times differ run to run)
_SAME = ["configuration", "final_loss", "metric", "output_diff_vs_O0", "error", "status"]


def test_a_plan_runs_what_the_keyword_call_runs():
    kw = mpnb.lab.compare(
        _tiny_workload(),
        configs=("O0", "O2"),
        half_dtype="bf16",
        optimizer="sgd",
        steps=4,
        progress=False,
        threads=1,
    )
    df = _plan().run()
    assert list(df.columns) == list(kw.columns)
    pd.testing.assert_frame_equal(df[_SAME], kw[_SAME])
    same = ["configuration", "step", "loss", "phase"]
    pd.testing.assert_frame_equal(df.attrs["history"][same], kw.attrs["history"][same])
    assert df.attrs["method"] == kw.attrs["method"]


def test_a_plan_is_a_value_replace_makes_a_variant_and_both_run():
    plan = _plan()
    fp32 = replace(plan, configs=replace(plan.configs, configs=("O0",)))
    assert plan.configs.configs == ("O0", "O2")  # the original is unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.timing = TimingPlan()
    assert list(fp32.run().configuration) == ["O0 fp32 b16"]
    assert sorted(plan.run().configuration) == ["O0 fp32 b16", "O2 bf16 b16"]


@pytest.mark.parametrize(
    "kw, plan",
    [
        (dict(ranks=0), Plan(distributed=DistributedPlan(ranks=0))),
        (dict(ranks=True), Plan(distributed=DistributedPlan(ranks=True))),
        (dict(strategy="ddp"), Plan(distributed=DistributedPlan(strategy="ddp"))),
        (dict(steps=1), Plan(WorkloadPlan(steps=1))),
        (dict(lr="x"), Plan(configs=ConfigsPlan(lr="x"))),
        (
            dict(lr=-1e-3, ranks=2),
            Plan(configs=ConfigsPlan(lr=-1e-3), distributed=DistributedPlan(ranks=2)),
        ),
        (dict(device="tpu"), Plan(timing=TimingPlan(device="tpu"))),
        (dict(workload="resnet50"), Plan(WorkloadPlan("resnet50"))),
        (dict(workload=_tiny()), Plan(WorkloadPlan(_tiny()))),
        (dict(workload="mlp", data=_data()), Plan(WorkloadPlan("mlp", data=_data()))),
        (dict(workload="mlp", configs=("O4",)), Plan(WorkloadPlan("mlp"), ConfigsPlan(("O4",)))),
        (
            dict(workload="mlp", optimizer="adagrad"),
            Plan(WorkloadPlan("mlp"), ConfigsPlan(optimizer="adagrad")),
        ),
        (
            dict(workload="mlp", ranks=2, batch_sizes=(8, 16)),
            Plan(WorkloadPlan("mlp", batch_sizes=(8, 16)), distributed=DistributedPlan(ranks=2)),
        ),
    ],
)
def test_a_bad_value_in_a_plan_raises_what_the_keyword_form_raises(kw, plan):
    with pytest.raises((TypeError, ValueError)) as by_keyword:
        mpnb.lab.compare(progress=False, **kw)
    with pytest.raises(by_keyword.type) as by_plan:
        replace(plan, output=OutputPlan(progress=False)).run()
    assert str(by_plan.value) == str(by_keyword.value)


@pytest.mark.parametrize("lr", ["x", -1e-3, float("nan"), float("inf"), True])
def test_a_bad_learning_rate_is_refused_before_any_row_runs(lr):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"compare: lr=.* must be"):
        mpnb.lab.compare("mlp", configs=("O0", "O2"), steps=2, lr=lr, progress=False)
    assert time.perf_counter() - t0 < 5  # refused up front, not once per row
    with pytest.raises(ValueError, match="the workload's"):
        expand("mlp", ("O0",), steps=2, lr=lr)


def test_configs_and_opt_levels_together_are_refused_as_before():
    with pytest.raises(TypeError, match="not both"):
        mpnb.lab.compare("mlp", configs=("O0",), opt_levels=("O1",), progress=False)


def test_a_group_of_the_wrong_kind_and_a_plan_given_to_compare_are_refused_with_the_fix():
    with pytest.raises(TypeError, match="WorkloadPlan"):
        Plan(workload="mlp")
    with pytest.raises(TypeError, match=r"plan\.run\(\)"):
        mpnb.lab.compare(Plan())


def test_the_keyword_form_keeps_its_signature():
    # notebooks, the CLI and the widget call compare by these names, with these defaults
    params = inspect.signature(mpnb.lab.compare).parameters
    assert {n: p.default for n, p in params.items()} == dict(
        workload="transformer",
        data=None,
        loss_fn=None,
        metric_fn=None,
        eval_data=None,
        configs=None,
        half_dtype="auto",
        batch_sizes=None,
        steps=None,
        size="auto",
        optimizer=None,
        lr=None,
        loss_scale=None,
        device="auto",
        seed=0,
        progress=True,
        isolate=False,
        threads=None,
        on_progress=None,
        should_stop=None,
        tolerance=TOLERANCE,
        opt_levels=None,
        ranks=None,
        strategy=None,
        timeout=600.0,
        compile_budget=None,
    )
    assert list(params)[:2] == ["workload", "data"]
    assert all(p.kind is p.KEYWORD_ONLY for p in list(params.values())[2:])
    # every keyword is a field of one group (opt_levels: the former name of configs)
    grouped = {f.name for g in fields(Plan) for f in fields(g.default_factory)}
    assert set(params) - grouped == {"opt_levels"}
