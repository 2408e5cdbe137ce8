"""samples/s counts the samples a step really trains on; a row states the batch size that ran
(a batch larger than the data is the whole data set), and the batch asked for is named."""

import math

import torch
from torch import nn

import mpnb.lab


def _data(n=40):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return x, x[:, :3].argmax(1)


def test_batch_larger_than_the_data_is_reported_clamped_and_counted_as_trained():
    df = mpnb.lab.compare(
        lambda: nn.Linear(8, 3),
        _data(),
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
        _data(),
        loss_fn=nn.functional.cross_entropy,
        opt_levels=("O0",),
        batch_sizes=(16,),
        steps=4,
        progress=False,
        threads=1,
    )
    r = df.iloc[0]
    assert r.samples_per_step == 16 and "asked" not in r.warnings
