"""The peers (torch-amp, tf32, torch-amp+compile) as rows of the same round-robin as mpnb's, the
lab's log read on the host in batches, host syncs per step, compile time apart, the verdict."""

import math

import pandas as pd
import pytest
import torch
from torch import nn

import mpnb.lab
from mpnb.lab import workloads
from mpnb.lab._step_log import READ_EVERY
from mpnb.lab._train import Trainer
from mpnb.lab._versus import versus_reference
from mpnb.lab.config import expand
from mpnb.lab.host_reads import HostReads
from tests.lab.test_runner import _data, _tiny
from tests.lab.test_runner import _tiny_workload as _workload


@pytest.fixture(scope="module")
def df():
    return mpnb.lab.compare(
        _workload(),
        configs=("O0", "O1", "O2", "torch-amp", "tf32"),
        half_dtype=("bf16", "fp16"),
        steps=14,
        optimizer="fused_adam",
        progress=False,
        threads=1,
    )


def test_the_peers_are_rows_of_the_same_round_robin(df):
    rows = df.set_index("configuration")
    amp_bf16, amp_fp16 = rows.loc["torch-amp bf16 b16"], rows.loc["torch-amp fp16 b16"]
    assert amp_bf16.status == amp_fp16.status == "ok", (amp_bf16.error, amp_fp16.error)
    hist = df.attrs["history"]
    first = hist[hist.step == 0].set_index("configuration")["loss"]
    # the same seed, model and batch: autocast's first loss is O1's, bit for bit, and the fp32
    # reference's within bf16's rounding
    assert first["torch-amp bf16 b16"] == first["O1 bf16 b16"]
    assert first["torch-amp fp16 b16"] == first["O1 fp16 b16"]
    assert first["torch-amp bf16 b16"] == pytest.approx(first["O0 fp32 b16"], rel=1e-2)
    assert (hist.groupby("configuration").size() == 14).all()  # all of them, every round
    assert amp_bf16.rounds == amp_fp16.rounds == rows.loc["O2 bf16 b16"].rounds > 0
    assert math.isfinite(amp_bf16.speedup_vs_O0) and amp_bf16.output_diff_vs_O0 > 0
    assert "torch.optim.AdamW(fused=True, weight_decay=0.0)" in amp_bf16.warnings
    # GradScaler on for fp16 (its default scale, no overflow here), off for bf16
    assert amp_fp16.final_loss_scale == 2.0**16 and amp_bf16.final_loss_scale == 1.0
    assert amp_fp16.skipped_steps == amp_bf16.skipped_steps == 0


def test_host_syncs_per_step_is_what_the_counter_says(df):
    rows = df.set_index("configuration")
    peers = rows.loc[["torch-amp bf16 b16", "torch-amp fp16 b16"], "host_syncs_per_step"]
    assert (peers == 0).all()
    ok = df[df.status == "ok"]
    assert ok.host_syncs_per_step.notna().all() and (ok.host_syncs_per_step >= 0).all()

    def reading_loss(out, y):  # a training step that reads the host once: its loss_fn's .item()
        loss = nn.functional.cross_entropy(out, y)
        loss.item()
        return loss

    w = workloads.custom(_tiny, _data(), reading_loss, batch_size=16)
    one = mpnb.lab.compare(w, configs=("O0", "torch-amp"), half_dtype="bf16", steps=6)
    # the step's own read, counted once: not the lab's bookkeeping (its log, its evaluation)
    assert one.set_index("opt_level").loc["torch-amp", "host_syncs_per_step"] == 1


def _w():
    return _workload()


def test_tf32_is_an_honest_unsupported_row_on_a_cpu(df):
    r = df.set_index("configuration").loc["tf32 b16"]
    assert r.status == "unsupported" and r.precision == "tf32 (unsupported)"
    assert "CUDA" in r.error and "no TF32" in r.error and r.steps_done == 0
    assert math.isnan(r.speedup_vs_O0) and "unsupported" in r.speed_label
    assert "torch.backends.cuda.matmul" in r.snippet  # the way to run it where it exists
    assert f"Not run: {r.error}." in df.attrs["verdict"]["text"]
    assert torch.get_float32_matmul_precision() == "highest"  # nothing left switched on


def test_the_verdict_compares_mpnb_best_with_torch_amp(df):
    v = df.attrs["verdict"]["versus_reference"]
    assert v is not None and v["reference"].startswith("torch-amp")
    assert v["mpnb"] in set(df.configuration) and not v["mpnb"].startswith(("O0", "torch"))
    assert v["text"] in df.attrs["verdict"]["text"] and "mpnb's best" in v["text"]
    assert v["rounds"] > 0


def _frame(t_mine, t_ref):
    """Two rows and O0 with the given per-round step times (timed phase)."""
    hist = [
        dict(configuration=c, step=k, step_time_ms=t, phase="timed")
        for c, ts in (("O0 fp32 b8", [10.0] * len(t_mine)), ("O2 bf16 b8", t_mine))
        for k, t in enumerate(ts)
    ] + [
        dict(configuration="torch-amp bf16 b8", step=k, step_time_ms=t, phase="timed")
        for k, t in enumerate(t_ref)
    ]
    rows = pd.DataFrame(
        dict(
            configuration=["O0 fp32 b8", "O2 bf16 b8", "torch-amp bf16 b8"],
            opt_level=["O0", "O2", "torch-amp"],
            half_dtype=["fp32", "bf16", "bf16"],
            batch_size=[8, 8, 8],
            speedup_vs_O0=[1.0, 1.2, 1.1],
        )
    )
    rows.attrs["history"] = pd.DataFrame(hist)
    return rows


def test_the_verdict_sentence_reads_the_paired_rounds():
    # the rounds drift together (a shared machine): the per-round ratio is 1.25 every round,
    # though the medians of the two rows alone would say 1.0
    drift = [8.0, 8.0, 8.0, 16.0, 16.0, 16.0, 16.0]
    faster = _frame(drift, [t * 1.25 for t in drift])
    v = versus_reference(faster, faster)
    assert v["ratio"] == pytest.approx(1.25) and v["lo"] == pytest.approx(1.25)
    assert v["text"] == (
        "mpnb's best, O2 bf16 b8, runs at 1.25x torch-amp bf16 b8's speed on this model and "
        "device (interval 1.25-1.25): faster than torch.amp."
    )
    same = _frame([10.0, 11.0, 9.0, 10.0, 10.5, 9.5], [10.0, 10.0, 10.0, 10.0, 10.0, 10.0])
    v = versus_reference(same, same)
    assert v["lo"] <= 1.0 <= v["hi"] and "no measurable difference" in v["text"]
    few = _frame([10.0, 10.0], [10.0, 10.0])
    assert "too few rounds" in versus_reference(few, few)["text"]
    alone = _frame([10.0] * 4, [10.0] * 4).iloc[:2]
    assert versus_reference(alone, alone) is None  # no torch-amp row: no sentence


def test_the_lab_reads_its_log_once_every_n_steps_not_every_step():
    [cfg] = expand("w", ("torch-amp",), "bf16", (16,), 2 * READ_EVERY + 3, device="cpu")
    t = Trainer(cfg, _w())
    reads = []
    for i in range(cfg.steps):
        with HostReads() as r:
            t.step(i)
        # the data loader's reads (its shuffle, each epoch) are of host tensors: not counted here
        reads.append(sum("/mpnb/lab/_data.py" not in where for where in r.where))
    # the step itself reads nothing (torch.amp with a fused AdamW); the log is read once a batch
    assert [i for i, n in enumerate(reads) if n] == [READ_EVERY - 1, 2 * READ_EVERY - 1]
    assert reads[READ_EVERY - 1] == 1
    assert len(t.res.history) == 2 * READ_EVERY  # the last 3 steps wait for the end of the run
    res = t.finish()
    assert [h["step"] for h in res.history] == list(range(cfg.steps))
    assert {"step", "loss", "loss_scale", "skipped", "skip_reason", "phase"} <= set(res.history[0])


def test_a_nan_found_at_a_batched_read_names_its_first_step_and_keeps_those_before():
    calls = {"n": 0}

    def loss_fn(out, y):
        calls["n"] += 1
        loss = nn.functional.cross_entropy(out, y)
        return loss * float("nan") if calls["n"] >= 6 else loss  # from step 5 on

    w = workloads.custom(_tiny, _data(), loss_fn, batch_size=16)
    df = mpnb.lab.compare(w, configs=("torch-amp",), half_dtype="bf16", steps=12, progress=False)
    assert "NaN divergence" in df.error[0] and "at step 5" in df.error[0], df.error[0]
    assert len(df.attrs["history"]) == 6 and df.steps_done[0] == 6  # steps 0-5


class _CompiledNet(nn.Module):
    """A model class of its own: no earlier compile in this process left graphs for it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 24), nn.Linear(24, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class _OverBudgetNet(_CompiledNet):
    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.slow
def test_compile_time_is_its_own_column_never_a_step_time():
    w = _workload(_CompiledNet)
    df = mpnb.lab.compare(
        w,
        configs=("O0", "torch-amp", "torch-amp+compile"),
        half_dtype="bf16",
        steps=10,
        progress=False,
        threads=1,
    )
    rows = df.set_index("opt_level")
    r = rows.loc["torch-amp+compile"]
    assert r.status == "ok", r.error
    assert r.compile_s > 0 and math.isnan(rows.loc["torch-amp", "compile_s"])
    hist = df.attrs["history"]
    mine = hist[hist.configuration == r.configuration]
    assert set(mine.phase) <= {"warmup", "memory", "timed"}  # nothing compiled in the steps
    assert mine.step_time_ms.max() < 1e3 * r.compile_s  # no step holds the compile
    assert r.step_time_ms < 1e3 * r.compile_s / 10 and r.host_syncs_per_step == 0
    first = hist[hist.step == 0].set_index("configuration")
    assert first.loc[r.configuration, "loss"] == pytest.approx(
        first.loc["torch-amp bf16 b16", "loss"], rel=1e-3
    )  # the warm-up left the model, data and seed as they were
    assert "model = torch.compile(model)" in r.snippet
    over = mpnb.lab.compare(
        _workload(_OverBudgetNet),
        configs=("O0", "torch-amp+compile"),
        half_dtype="bf16",
        steps=4,
        progress=False,
        threads=1,
        compile_budget=1e-3,
    ).set_index("opt_level")
    err = over.loc["torch-amp+compile", "error"]
    assert over.loc["torch-amp+compile", "status"] == "error" and over.loc["O0", "status"] == "ok"
    assert "budget of 0.001 s" in err and "--compile-budget" in err
    assert "leave torch-amp+compile out" in err
