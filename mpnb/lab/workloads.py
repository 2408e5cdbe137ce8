"""Workloads: a model, data, a loss and a quality metric, all available offline.

Built in (``mpnb.lab.workloads.get(name)``):

* ``"mlp"``: a 2-layer MLP on scikit-learn's bundled 8x8 digits, accuracy on a held-out split.
* ``"cnn"``: a small CNN with batch norm on the same digits, held-out accuracy.
* ``"transformer"``: a tiny GPT-style language model (fused layer norm, causal attention,
  fused softmax) on deterministically generated text, held-out next-token accuracy
  (``eval_loss`` is the mean cross-entropy, so perplexity is ``exp(eval_loss)``).

Your own: :func:`custom` from ``model_fn``, data (``(x, y)`` tensors, a ``Dataset`` or a
``DataLoader``), ``loss_fn`` and an optional ``metric_fn``.

Example::

    >>> from mpnb.lab import workloads
    >>> w = workloads.custom(lambda: torch.nn.Linear(4, 2), (torch.randn(64, 4),
    ...                      torch.randint(0, 2, (64,))), torch.nn.functional.cross_entropy)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

__all__ = ["Workload", "custom", "get", "names", "accuracy"]

Batch = tuple[object, torch.Tensor]


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    """Share (0..1) of argmax predictions over the last dim that equal ``target``."""
    return (output.argmax(-1) == target).float().mean().item()


def _flat_ce(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


@dataclass(frozen=True)
class Workload:
    """A trainable task with a quality metric.

    Args:
        name: shown in the table.
        model_fn: builds a fresh fp32 model (called once per configuration, after seeding).
        train: ``(inputs, targets)`` tensors, a ``Dataset`` or a ``DataLoader``.
        eval: held-out data in the same forms (None: the metric is skipped).
        loss_fn: ``(output, target) -> scalar loss`` (the output is cast to fp32 first).
        metric_fn: ``(output, target) -> float`` on an eval batch, averaged over the eval set.
        metric_name: the metric's name in the table (``"accuracy"``).
        chance: the metric of a random guess (shown and used by the tests).
        lr, batch_size, steps: defaults for ``compare``.
    """

    name: str
    model_fn: Callable[[], nn.Module]
    train: object
    eval: object = None
    loss_fn: Callable = nn.functional.cross_entropy
    metric_fn: Callable | None = None
    metric_name: str = "metric"
    chance: float | None = None
    lr: float = 1e-3
    batch_size: int = 64
    steps: int = 100

    def loader(self, data, batch_size: int, seed: int, train: bool) -> DataLoader:
        """``data`` as a ``DataLoader`` with a seeded shuffle (a given loader is used as is)."""
        if isinstance(data, DataLoader):
            return data
        if isinstance(data, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in data):
            data = TensorDataset(*data)
        if not isinstance(data, Dataset):
            raise TypeError(
                f"workload {self.name!r}: data must be (inputs, targets) tensors, "
                f"a Dataset or a DataLoader, got {type(data).__name__}."
            )
        g = torch.Generator().manual_seed(seed)
        return DataLoader(
            data,
            batch_size=batch_size,
            shuffle=train,
            generator=g,
            drop_last=train and len(data) >= batch_size,
        )

    def batches(self, batch_size: int, seed: int) -> Iterator[Batch]:
        """Training batches forever, in the same order for the same seed."""
        loader = self.loader(self.train, batch_size, seed, train=True)
        while True:
            empty = True
            for batch in loader:
                empty = False
                yield _split(batch, self.name)
            if empty:
                raise ValueError(f"workload {self.name!r}: the training data is empty.")

    def eval_batches(self, batch_size: int = 256) -> Iterator[Batch]:
        """The held-out data, once, in a fixed order."""
        if self.eval is None:
            return
        for batch in self.loader(self.eval, batch_size, 0, train=False):
            yield _split(batch, self.name)

    def fixed_batch(self, size: int = 64) -> Batch:
        """The batch every configuration's output is compared on (the first held-out one)."""
        data = self.eval if self.eval is not None else self.train
        return next(iter(_split(b, self.name) for b in self.loader(data, size, 0, train=False)))


def _split(batch, name: str) -> Batch:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    n = len(batch) if hasattr(batch, "__len__") else "?"
    raise ValueError(
        f"workload {name!r}: each batch must be (inputs, targets), got "
        f"{type(batch).__name__} of length {n}."
    )


def custom(
    model_fn: Callable[[], nn.Module],
    data,
    loss_fn: Callable,
    metric_fn: Callable | None = None,
    eval_data=None,
    name: str = "custom",
    metric_name: str | None = None,
    lr: float = 1e-3,
    batch_size: int = 64,
    steps: int = 100,
) -> Workload:
    """A workload from your own model, data, loss and (optional) metric.

    Args:
        model_fn: a zero-argument callable returning a fresh fp32 ``nn.Module``.
        data: training data: ``(inputs, targets)`` tensors, a ``Dataset`` or a ``DataLoader``.
        loss_fn: ``(output, target) -> loss``.
        metric_fn: ``(output, target) -> float`` (higher or lower is better: you say which
            in ``metric_name``); evaluated on ``eval_data`` (default: the training data).
        eval_data: held-out data in the same forms.

    Example::

        >>> w = custom(lambda: nn.Linear(8, 3), (torch.randn(256, 8), torch.randint(0, 3, (256,))),
        ...            nn.functional.cross_entropy, metric_fn=accuracy, metric_name="accuracy")
    """
    if not callable(model_fn) or isinstance(model_fn, nn.Module):
        raise TypeError(
            "custom: model_fn must be a function returning a fresh model "
            "(lambda: MyNet()), not a model: every configuration starts from the "
            "same fresh weights."
        )
    if not callable(loss_fn):
        raise TypeError(f"custom: loss_fn must be callable, got {type(loss_fn).__name__}.")
    ev = data if eval_data is None and metric_fn is not None else eval_data
    return Workload(
        name,
        model_fn,
        data,
        ev,
        loss_fn,
        metric_fn,
        metric_name or ("metric" if metric_fn else "-"),
        None,
        lr,
        batch_size,
        steps,
    )


def _digits(seed: int = 0):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    return (x[:1300], y[:1300]), (x[1300:], y[1300:])


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


class DigitsCNN(nn.Module):
    """Two conv + batch-norm blocks and a linear head for 8x8 digits (flattened inputs)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 4, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x.view(-1, 1, 8, 8))


_SEQ = 24


def _lm_model() -> nn.Module:
    from mpnb.lab._text import VOCAB, TinyLM

    return TinyLM(len(VOCAB), _SEQ)


def _builtin(name: str) -> Workload:
    if name in ("mlp", "cnn"):
        train, ev = _digits()
        make = _mlp if name == "mlp" else DigitsCNN
        return Workload(
            name,
            make,
            train,
            ev,
            nn.functional.cross_entropy,
            accuracy,
            "accuracy",
            0.1,
            lr=1e-2 if name == "mlp" else 5e-3,
            batch_size=64,
            steps=150,
        )
    from mpnb.lab._text import VOCAB, generate_tokens, lm_sequences

    train = lm_sequences(generate_tokens(30_000, seed=0), _SEQ)
    ev = lm_sequences(generate_tokens(3_000, seed=1), _SEQ)
    return Workload(
        "transformer",
        _lm_model,
        train,
        ev,
        _flat_ce,
        accuracy,
        "next-token accuracy",
        1.0 / len(VOCAB),
        lr=1e-2,
        batch_size=16,
        steps=150,
    )


_BUILTIN = ("mlp", "cnn", "transformer")


def names() -> tuple[str, ...]:
    """The built-in workloads' names."""
    return _BUILTIN


def get(workload: str | Workload) -> Workload:
    """A built-in workload by name, or ``workload`` itself if it is already a Workload."""
    if isinstance(workload, Workload):
        return workload
    if workload not in _BUILTIN:
        raise ValueError(
            f"workload={workload!r} is unknown; built in: {', '.join(_BUILTIN)} "
            "(or pass mpnb.lab.workloads.custom(...))."
        )
    return _builtin(workload)
