"""``mpnb.lab._data``: the data forms users have (tensors, a DataLoader, a generator function,
an iterator), and mismatched tensors, outputs a loss cannot read, a batch the data cannot
fill: each gets a message that names the problem and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mpnb.lab
from mpnb.lab import workloads
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


class TinyCNN(nn.Module):
    """A torchvision-free CNN for 1x12x12 images."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 2),
        )

    def forward(self, x):
        return self.net(x)


def _images(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 12, 12, generator=g)
    return x, (x.mean((1, 2, 3)) > 0).long()


def test_cnn_with_a_dataloader_generator_function_and_iterator():
    x, y = _images()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    gen_fn = lambda: ((x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16))  # noqa: E731
    iterator = iter([(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)])
    for data in (loader, gen_fn, iterator):
        df = mpnb.lab.compare(
            TinyCNN,
            data,
            metric_fn=workloads.accuracy,
            eval_data=_images(32, 1),
            opt_levels=("O0", "O2"),
            steps=5,
            progress=False,
            threads=1,
        )
        assert (df.status == "ok").all(), df.error.tolist()
        assert list(df.batch_size) == [16, 16] and (df.mem_activations_mib > 0).all()
    with pytest.raises(ValueError, match="fixes the batch size"):
        mpnb.lab.compare(TinyCNN, loader, batch_sizes=(8,), progress=False)
