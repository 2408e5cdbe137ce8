"""``mpnb.lab.compare``: every column for every opt level and dtype, error rows, the scaler."""

import math

import pytest
import torch
from torch import nn

import mpnb.lab
from mpnb.lab import workloads
from mpnb.lab.config import expand
from mpnb.lab.runner import COLUMNS


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
