"""``mpnb.lab._rows``: a row states the batch size that ran (a batch larger than the data is
the whole data set, and the batch asked for is named), samples/s counts the samples trained
on, and too few timed steps give no speed figure."""

from __future__ import annotations

import math

import torch
from torch import nn

import mpnb.lab
from mpnb.lab import workloads


def _small_data(n=40):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return x, x[:, :3].argmax(1)


def test_batch_larger_than_the_data_is_reported_clamped_and_counted_as_trained():
    df = mpnb.lab.compare(
        lambda: nn.Linear(8, 3),
        _small_data(),
        loss_fn=nn.functional.cross_entropy,
        opt_levels=("O0",),
        batch_sizes=(1_000_000,),
        steps=4,
        progress=False,
        threads=1,
    )
    r = df.iloc[0]
    assert r.status == "ok", r.error
    assert r.batch_size == 40 and r.samples_per_step == 40  # what ran, not what was asked
    assert "batch size 1000000 asked" in r.warnings and "b40" in r.configuration
    # samples/s is the real batch over the median step time, not the requested batch
    assert math.isclose(r.samples_per_s, 40 / (r.step_time_ms / 1e3), rel_tol=1e-6)


def test_a_batch_the_data_fills_is_not_reported_clamped():
    df = mpnb.lab.compare(
        lambda: nn.Linear(8, 3),
        _small_data(),
        loss_fn=nn.functional.cross_entropy,
        opt_levels=("O0",),
        batch_sizes=(16,),
        steps=4,
        progress=False,
        threads=1,
    )
    r = df.iloc[0]
    assert r.samples_per_step == 16 and "asked" not in r.warnings


def _tiny():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def test_too_few_timed_steps_give_no_ratio_but_say_so():
    """--steps 2 timed one round and printed '2.00x faster than O0' with no interval, while
    the verdict (which needs the interval) said nothing was faster."""
    w = workloads.custom(_tiny, _data(), nn.functional.cross_entropy, batch_size=16)
    for steps, rounds in ((2, 1), (3, 2)):
        df = mpnb.lab.compare(w, opt_levels=("O0", "O1"), steps=steps, progress=False, threads=1)
        o1 = df.set_index("opt_level").loc["O1"]
        assert o1.rounds == rounds and math.isnan(o1.speedup_vs_O0)
        assert o1.speed_label.startswith("too few timed steps for a speed figure")
        assert "faster" not in o1.speed_label and "slower" not in o1.speed_label
        assert f"{rounds} round" in o1.speed_label and "run more steps" in o1.speed_label
        assert "x faster than O0" not in df.attrs["verdict"]["text"]
    df = mpnb.lab.compare(w, opt_levels=("O0", "O1"), steps=4, progress=False, threads=1)
    o1 = df.set_index("opt_level").loc["O1"]  # 3 rounds: a figure with its interval
    assert o1.rounds == 3 and o1.speedup_lo <= o1.speedup_vs_O0 <= o1.speedup_hi
    assert not o1.speed_label.startswith("too few")


def _data(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return x, x[:, :4].argmax(1)
