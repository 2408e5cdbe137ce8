"""The lab's data forms: mismatched tensors, outputs a loss cannot read, a batch the data
cannot fill: each gets a message that names the problem and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpnb.lab._data import DataSource
from mpnb.lab._train import train_once


def test_tensors_of_different_lengths_are_named():
    x, y = torch.randn(64, 4), torch.randint(0, 2, (50,))
    with pytest.raises(ValueError, match=r"64 and 50 samples"):
        DataSource((x, y), "demo")


def test_batch_size_that_runs_is_the_data_size_when_larger():
    src = DataSource((torch.randn(8, 4), torch.zeros(8, dtype=torch.long)), "demo")
    assert src.batch_size_for(64) == 8
    assert src.batch_size_for(4) == 4
    assert next(src.batches(src.batch_size_for(64), seed=0))[0].shape[0] == 8


class _NoReturn(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        self.fc(x)  # no return: the output is None


class _Step:
    """The smallest TrainStep stand-in: run() calls the loss closure on the model."""

    module = _NoReturn()

    def run(self, x, y, loss):
        return loss(self.module, x, y)


def test_a_model_returning_none_names_loss_fn_and_the_missing_return():
    def ce(out, y):
        return nn.functional.cross_entropy(out, y)

    with pytest.raises(TypeError, match=r"returned None.*return") as e:
        train_once(_Step(), torch.randn(2, 4), torch.zeros(2, dtype=torch.long), ce)
    assert "loss_fn" in str(e.value) and "metric_fn" not in str(e.value)
