"""``mpnb.lab._step_log``: the per-step log stays on the device and is read a batch of steps
at a time; a NaN found at a batched read is named by its first step."""

from __future__ import annotations

from torch import nn

import mpnb.lab
from mpnb.lab import workloads
from mpnb.lab._step_log import READ_EVERY
from mpnb.lab._train import Trainer
from mpnb.lab.config import expand
from mpnb.lab.host_reads import HostReads
from tests.lab.test_runner import _data, _tiny
from tests.lab.test_runner import _tiny_workload as _workload


def _w():
    return _workload()


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
