"""Training data in the forms users have it, turned into the same batches for every configuration.

Accepted: ``(inputs, targets)`` tensors, a ``Dataset``, a ``DataLoader``, a generator function
(a zero-argument callable returning an iterator of batches, called once per configuration),
or an iterator/generator object (consumed once; its batches are kept so that every
configuration trains on the same ones). A batch is ``(inputs, targets)``, or a dict of
tensors (Hugging Face style: the model is called with ``**batch`` and the targets are
``batch["labels"]``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

__all__ = ["Batch", "DataSource", "split_batch", "batch_len", "first_batches", "is_data"]

Batch = tuple[object, object]


def split_batch(batch, name: str) -> Batch:
    """``(inputs, targets)`` of one batch; a dict batch is its own input (targets: labels)."""
    if isinstance(batch, dict):
        return batch, batch.get("labels")
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    n = len(batch) if hasattr(batch, "__len__") else "?"
    raise ValueError(
        f"workload {name!r}: each batch must be (inputs, targets) or a dict of tensors with "
        f"'labels', got {type(batch).__name__} of length {n}."
    )


def batch_len(x) -> int:
    """The number of samples in a batch's inputs (first dim of the first tensor found)."""
    if isinstance(x, torch.Tensor):
        return int(x.shape[0]) if x.dim() else 1
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (tuple, list)):
        for v in x:
            if isinstance(v, torch.Tensor) and v.dim():
                return int(v.shape[0])
    return 1


class _Cached:
    """An iterator's batches, pulled once and shared (every configuration sees the same)."""

    def __init__(self, it: Iterator):
        self._it, self.items, self.done = it, [], False
        self._lock = threading.Lock()

    def get(self, i: int):
        with self._lock:
            while len(self.items) <= i and not self.done:
                try:
                    self.items.append(next(self._it))
                except StopIteration:
                    self.done = True
            return self.items[i] if i < len(self.items) else None


class DataSource:
    """One of the accepted data forms, iterated the same way for every configuration.

    Args:
        data: tensors, a ``Dataset``, a ``DataLoader``, a generator function or an iterator.
        name: the workload's name (for error messages).

    Example::

        >>> src = DataSource((torch.randn(64, 4), torch.randint(0, 2, (64,))), "demo")
        >>> x, y = next(src.batches(16, seed=0, train=True))
    """

    def __init__(self, data, name: str):
        self.name = name
        if isinstance(data, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in data):
            data = TensorDataset(*_same_length(data, name))
        if isinstance(data, (Dataset, DataLoader)):
            self.kind, self.data = "dataset", data
        elif isinstance(data, Iterator):
            self.kind, self.data = "iterator", _Cached(data)
        elif callable(data):
            self.kind, self.data = "function", data
        else:
            raise TypeError(
                f"workload {name!r}: data must be (inputs, targets) tensors, a Dataset, a "
                f"DataLoader, a generator function or an iterator of batches, got "
                f"{type(data).__name__}."
            )

    @property
    def fixed_batch_size(self) -> int | None:
        """The batch size the data imposes (a DataLoader's, the first batch of a generator
        or iterator), or None for tensors and Datasets (any batch size works)."""
        if isinstance(self.data, DataLoader):
            return self.data.batch_size
        if self.kind == "iterator":
            first = self.data.get(0)
        elif self.kind == "function":  # one call to see the first batch
            first = next(iter(self.data()), None)
        else:
            return None
        return None if first is None else batch_len(split_batch(first, self.name)[0])

    def batch_size_for(self, batch_size: int) -> int:
        """The batch size a run asking for ``batch_size`` trains on: the data set's size when
        tensors or a Dataset hold fewer samples (each batch is then the whole data set), else
        ``batch_size``. A row and its label state this one, the batch size that ran."""
        if self.kind == "dataset" and not isinstance(self.data, DataLoader):
            n = len(self.data)
            return min(batch_size, n) if n else batch_size
        return batch_size

    def _raw(self, batch_size: int, seed: int, train: bool) -> Iterator:
        if isinstance(self.data, DataLoader):
            return iter(self.data)
        if self.kind == "dataset":
            g = torch.Generator().manual_seed(seed)
            n = len(self.data)
            return iter(
                DataLoader(
                    self.data,
                    batch_size=self.batch_size_for(batch_size),
                    shuffle=train,
                    generator=g,
                    drop_last=train and n >= batch_size,
                )
            )
        if self.kind == "function":
            it = self.data()
            if not isinstance(it, Iterator):
                it = iter(it)
            return it
        return _replay(self.data)

    def batches(self, batch_size: int, seed: int, train: bool = True) -> Iterator[Batch]:
        """``(inputs, targets)`` batches; training batches repeat forever (epoch after epoch)."""
        while True:
            empty = True
            for batch in self._raw(batch_size, seed, train):
                empty = False
                yield split_batch(batch, self.name)
            if empty:
                raise ValueError(
                    f"workload {self.name!r}: the {'training' if train else 'eval'} data is "
                    "empty; pass at least one batch."
                )
            if not train:
                return


def _same_length(tensors, name: str) -> tuple[torch.Tensor, ...]:
    """``tensors`` when they hold one entry per sample each (equal first dims), else the
    ValueError that names their lengths (torch's TensorDataset only asserts)."""
    lengths = [int(t.shape[0]) if t.dim() else None for t in tensors]
    if None in lengths:
        raise ValueError(
            f"workload {name!r}: data tensor {lengths.index(None)} is a 0-dim tensor; every "
            "data tensor needs a first dim of one entry per sample (inputs (N, ...), targets "
            "(N,))."
        )
    if len(set(lengths)) > 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise ValueError(
            f"workload {name!r}: the data tensors hold {' and '.join(map(str, lengths))} "
            f"samples (shapes {shapes}); every tensor needs one entry per sample along its "
            "first dim: pass inputs and targets of the same length (slice the longer one)."
        )
    return tuple(tensors)


def _replay(cache: _Cached) -> Iterator:
    i = 0
    while (batch := cache.get(i)) is not None:
        yield batch
        i += 1


def first_batches(src: DataSource, n: int, batch_size: int) -> Iterator[Batch]:
    """The first ``n`` batches of ``src`` in a fixed order (an eval set made of training data)."""
    it = src.batches(batch_size, seed=0, train=False)
    for _ in range(n):
        try:
            yield next(it)
        except StopIteration:
            return


def is_data(obj) -> bool:
    """True for the data forms :class:`DataSource` accepts (used to tell data from names)."""
    if isinstance(obj, (Dataset, DataLoader, Iterator)):
        return True
    return isinstance(obj, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in obj)
