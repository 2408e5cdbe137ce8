"""Digits (scikit-learn's bundled 8x8 images): O0/O1/O2/O3 in bf16 train to O0's accuracy."""

import pytest
import torch
from sklearn.datasets import load_digits

from mpnb import amp

STEPS, BATCH = 150, 32


def _data():
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    x, y = x[perm], y[perm]
    return x[:1300], y[:1300], x[1300:], y[1300:]


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


class _CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(8 * 16, 10),
        )

    def forward(self, x):
        return self.body(x.view(-1, 1, 8, 8))


def _accuracy(make, level):
    xtr, ytr, xte, yte = _data()
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        idx = torch.randint(0, len(xtr), (BATCH,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(xtr[idx]).float(), ytr[idx])
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        pred = model(xte).float().argmax(1)
    return (pred == yte).float().mean().item() * 100


@pytest.mark.slow
@pytest.mark.parametrize("make", [_mlp, _CNN], ids=["mlp", "cnn"])
def test_digits_bf16_levels_match_o0(make):
    acc = {lvl: _accuracy(make, lvl) for lvl in ("O0", "O1", "O2", "O3")}
    assert acc["O0"] > 90, acc
    for lvl in ("O1", "O2", "O3"):
        assert abs(acc[lvl] - acc["O0"]) <= 1.0, acc
