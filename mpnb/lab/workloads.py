"""Workloads: a model, data, a loss and a quality metric, all available offline.

Built in (``mpnb.lab.workloads.get(name, size)``), each in three fixed sizes
(``"small"``, ``"medium"``, ``"large"``; see :data:`SIZES`) and one sized for the CUDA device
at hand (``"gpu"``, :data:`GPU_SIZE`; see :mod:`mpnb.lab.gpu_sizing`):

* ``"transformer"`` (the default): a small GPT (fused layer norm, causal attention, fused
  softmax) on deterministically generated English-like text; held-out next-token accuracy
  (``eval_loss`` is the mean cross-entropy, so perplexity is ``exp(eval_loss)``).
* ``"cnn"``: a CNN with batch norm on scikit-learn's bundled digits, upsampled to
  16x16 / 32x32 / 64x64; held-out accuracy.
* ``"mlp"``: a 2-layer MLP on the 8x8 digits (upsampled to 64x64 at the ``"gpu"`` size);
  held-out accuracy.

``size="auto"`` is ``"small"`` on a CPU (where half precision is usually emulated and slow)
and ``"gpu"`` on CUDA: sized from the card's memory and fp32 peak so that the fp32 step keeps
the GPU busy instead of waiting on kernel launches (an H100 gets a GPT of width 1024,
12 layers, 1024 tokens, batch 4). Your own: :func:`custom` (model factory, data in any form,
loss and metric), or :func:`mpnb.lab.hf.transformers_workload` for Hugging Face models.

Example::

    >>> from mpnb.lab import workloads
    >>> w = workloads.get("transformer", "small")
    >>> w.batch_size, w.steps
    (16, 40)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn

from mpnb.lab._data import Batch, DataSource, first_batches
from mpnb.lab.gpu_sizing import GpuSpec, gpu_plans

__all__ = [
    "Workload",
    "custom",
    "get",
    "names",
    "accuracy",
    "default_loss",
    "logits_of",
    "SIZES",
    "GPU_SIZE",
    "resolve_size",
    "size_spec",
]

#: the fixed sizes, the same on every device
SIZES = ("small", "medium", "large")
#: the size computed from a CUDA device's properties (:func:`mpnb.lab.gpu_sizing.gpu_plans`)
GPU_SIZE = "gpu"


def logits_of(output):
    """The logits inside a model's output: the tensor itself, ``output["logits"]`` (a dict or
    ``ModelOutput``), ``output.logits`` (a dataclass), or the first tensor of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) or hasattr(output, "keys"):
        if "logits" in output:
            return output["logits"]
        return next(v for v in output.values() if isinstance(v, torch.Tensor))
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)):
        return next(v for v in output if isinstance(v, torch.Tensor))
    raise TypeError(
        f"cannot find logits in a {type(output).__name__}: the default loss (cross-entropy) "
        "and metric (accuracy) read logits; pass loss_fn=(output, target) -> loss and "
        "metric_fn=(output, target) -> float that read your model's output, or return the "
        "logits."
    )


def default_loss(output) -> torch.Tensor:
    """The loss the lab's tools use when given none: the mean of the squared float32 logits
    (:func:`logits_of`), so any output form (tensor, tuple, dict, dataclass) has one.

    Example::

        >>> default_loss(torch.ones(2, 3))
        tensor(1.)
    """
    return logits_of(output).float().pow(2).mean()


def accuracy(output, target: torch.Tensor) -> float:
    """Share (0..1) of argmax predictions over the last dim that equal ``target``.

    ``output`` may be a tensor or any model output holding logits (see :func:`logits_of`).
    """
    return (logits_of(output).argmax(-1) == target).float().mean().item()


def _flat_ce(output, target: torch.Tensor) -> torch.Tensor:
    out = logits_of(output).float()
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def _ce(output, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits_of(output).float(), target)


@dataclass(frozen=True)
class Workload:
    """A trainable task with a quality metric.

    Args:
        name: shown in the table.
        model_fn: builds a fresh fp32 model (called once per configuration, after seeding).
        train: training data (see :class:`mpnb.lab._data.DataSource` for the forms).
        eval: held-out data in the same forms (None: the metric is measured on the first
            training batches, and a warning says so).
        loss_fn: ``(output, target) -> scalar loss``; ``output`` is exactly what the model
            returned (a tensor, tuple, dict, dataclass or ``ModelOutput``), in whatever dtype
            the opt level produced.
        metric_fn: ``(output, target) -> float`` on an eval batch, averaged over the eval set.
        metric_name: the metric's name in the table (``"accuracy"``).
        chance: the metric of a random guess (shown and used by the tests).
        lr, batch_size, steps: defaults for ``compare``.
        size: ``"small"``/``"medium"``/``"large"``/``"gpu"`` for built-ins, ``""`` for
            custom ones.
        description: one line for the report: the model and the data (not the batch size
            or the steps: a run may change them, and the report prints the run's own).
    """

    name: str
    model_fn: Callable[[], nn.Module]
    train: object
    eval: object = None
    loss_fn: Callable = _ce
    metric_fn: Callable | None = None
    metric_name: str = "metric"
    chance: float | None = None
    lr: float = 1e-3
    batch_size: int = 64
    steps: int = 100
    size: str = ""
    description: str = ""

    @functools.cached_property
    def _train_src(self) -> DataSource:
        return DataSource(self.train, self.name)

    @functools.cached_property
    def _eval_src(self) -> DataSource | None:
        return None if self.eval is None else DataSource(self.eval, self.name)

    @property
    def data_batch_size(self) -> int | None:
        """The batch size the training data imposes (a DataLoader, an iterator), or None."""
        return self._train_src.fixed_batch_size

    def batch_size_for(self, batch_size: int) -> int:
        """The batch size a run asking for ``batch_size`` trains on (the data set's size when
        it holds fewer samples): what the row states."""
        return self._train_src.batch_size_for(batch_size)

    def batches(self, batch_size: int, seed: int) -> Iterator[Batch]:
        """Training batches forever, in the same order for the same seed."""
        return self._train_src.batches(batch_size, seed, train=True)

    def eval_batches(self, batch_size: int = 256) -> Iterator[Batch]:
        """The held-out data once, in a fixed order (or the first 4 training batches)."""
        if self._eval_src is None:
            return first_batches(self._train_src, 4, batch_size)
        return self._eval_src.batches(batch_size, 0, train=False)

    def fixed_batch(self, size: int = 64) -> Batch:
        """The batch every configuration's output is compared on (the first eval one)."""
        return next(iter(self.eval_batches(size)))

    def __getstate__(self):  # the cached data sources are rebuilt after unpickling
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


def custom(
    model_fn: Callable[[], nn.Module],
    data,
    loss_fn: Callable | None = None,
    metric_fn: Callable | None = None,
    eval_data=None,
    name: str = "custom",
    metric_name: str | None = None,
    lr: float = 1e-3,
    batch_size: int | None = None,
    steps: int = 100,
) -> Workload:
    """A workload from your own model factory, data, loss and (optional) metric.

    Args:
        model_fn: a zero-argument callable returning a fresh fp32 ``nn.Module``.
        data: ``(inputs, targets)`` tensors, a ``Dataset``, a ``DataLoader``, a generator
            function (called once per configuration) or an iterator of batches (consumed
            once and replayed, so every configuration trains on the same batches).
        loss_fn: ``(output, target) -> loss``; receives exactly what the model returned
            (default: cross-entropy on the output's logits).
        metric_fn: ``(output, target) -> float`` (you say what it is in ``metric_name``);
            evaluated on ``eval_data`` (default: the first training batches).
        eval_data: held-out data in the same forms.
        batch_size: default: the data's own (a DataLoader's), else 64.

    Example::

        >>> w = custom(lambda: nn.Linear(8, 3), (torch.randn(256, 8), torch.randint(0, 3, (256,))),
        ...            metric_fn=accuracy, metric_name="accuracy")
    """
    if not callable(model_fn) or isinstance(model_fn, nn.Module):
        raise TypeError(
            "custom: model_fn must be a function returning a fresh model "
            "(lambda: MyNet()), not a model: every configuration starts from the "
            "same fresh weights."
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"custom: loss_fn must be callable, got {type(loss_fn).__name__}.")
    w = Workload(
        name,
        model_fn,
        data,
        eval_data,
        loss_fn or _ce,
        metric_fn,
        metric_name or ("metric" if metric_fn else "-"),
        None,
        lr,
        batch_size or 64,
        steps,
    )
    bs = w.data_batch_size
    if bs is not None and batch_size is None:
        w = _replace(w, batch_size=bs)
    return w


def _replace(w: Workload, **kw) -> Workload:
    return replace(w, **kw)


# ---- the built-in workloads ---------------------------------------------------------------------

#: per size: model and data dimensions, batch size, steps and learning rate
SIZES_SPEC = {
    "transformer": {
        "small": dict(d=64, layers=2, seq=64, batch=16, steps=40, lr=3e-3),
        "medium": dict(d=128, layers=4, seq=128, batch=32, steps=100, lr=2e-3),
        "large": dict(d=256, layers=6, seq=256, batch=32, steps=200, lr=1e-3),
    },
    "cnn": {
        "small": dict(scale=2, width=16, batch=64, steps=40, lr=5e-3),
        "medium": dict(scale=4, width=32, batch=128, steps=100, lr=3e-3),
        "large": dict(scale=8, width=64, batch=128, steps=200, lr=2e-3),
    },
    "mlp": {
        "small": dict(hidden=128, batch=64, steps=60, lr=1e-2),
        "medium": dict(hidden=1024, batch=256, steps=100, lr=3e-3),
        "large": dict(hidden=4096, batch=512, steps=200, lr=1e-3),
    },
}
_BUILTIN = tuple(SIZES_SPEC)


def resolve_size(size: str | None, device: str = "cpu") -> str:
    """The size ``size`` names on ``device``: ``"auto"`` (or None) is ``"small"`` on a CPU and
    :data:`GPU_SIZE` on CUDA; the others are checked and returned.

    Args:
        size: ``"auto"``, None, one of :data:`SIZES` or :data:`GPU_SIZE`.
        device: where the workload will run.

    Example::

        >>> resolve_size("auto", "cpu"), resolve_size("auto", "cuda:0"), resolve_size("large")
        ('small', 'gpu', 'large')
    """
    if size in (None, "auto"):
        return GPU_SIZE if str(device).startswith("cuda") else "small"
    if size not in (*SIZES, GPU_SIZE):
        raise ValueError(
            f"size={size!r} is invalid; use 'small', 'medium', 'large', 'gpu' (sized for the "
            "CUDA device) or 'auto' (small on CPU, gpu on CUDA)."
        )
    return size


def size_spec(name: str, size: str, device: str = "cpu") -> dict:
    """The dimensions, batch, steps and learning rate of built-in ``name`` at ``size``.

    :data:`GPU_SIZE` reads the CUDA device's properties: ``device`` when it is a CUDA device,
    else the current one (so a process that rebuilds a workload from its name and size, as the
    distributed ranks do, gets the same sizes on the same card).

    Args:
        name: a built-in workload (:func:`names`).
        size: one of :data:`SIZES` or :data:`GPU_SIZE` (resolve ``"auto"`` first).
        device: the device the workload runs on.

    Example::

        >>> size_spec("transformer", "small")["d"]
        64
    """
    if size != GPU_SIZE:
        return SIZES_SPEC[name][size]

    if not torch.cuda.is_available():
        raise ValueError(
            f"size={GPU_SIZE!r} sizes the workload from a CUDA device's properties, and torch "
            "sees no CUDA device here; pass size='small', 'medium' or 'large' (or 'auto')."
        )
    cuda = str(device) if str(device).startswith("cuda") else "cuda"
    return gpu_plans(GpuSpec.of(cuda))[name].spec


def _digits(scale: int, seed: int = 0):
    # optional: scikit-learn, +1.4 s to import
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    if scale > 1:
        x = nn.functional.interpolate(x, scale_factor=scale, mode="bilinear", align_corners=False)
    y = torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    return (x[:1300], y[:1300]), (x[1300:], y[1300:])


class DigitsMLP(nn.Module):
    """Two linear layers on flattened digits (any image size)."""

    def __init__(self, pixels: int = 64, hidden: int = 128):
        super().__init__()
        self.body = nn.Sequential(
            nn.Flatten(), nn.Linear(pixels, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class DigitsCNN(nn.Module):
    """Three conv + batch-norm blocks and a linear head for square digit images.

    The batch norms' running statistics use momentum 0.3 (torch's default is 0.1): after the
    few dozen steps of a default run, 0.1 leaves them far from the data's statistics and
    the held-out accuracy then swings between seeds.
    """

    def __init__(self, width: int = 16, side: int = 16):
        super().__init__()
        w = width
        self.body = nn.Sequential(
            nn.Conv2d(1, w, 3, padding=1),
            nn.BatchNorm2d(w, momentum=0.3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(w, 2 * w, 3, padding=1),
            nn.BatchNorm2d(2 * w, momentum=0.3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * w, 2 * w, 3, padding=1),
            nn.BatchNorm2d(2 * w, momentum=0.3),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(8 * w, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _image_workload(name: str, size: str, device: str) -> Workload:
    s = size_spec(name, size, device)
    scale = s.get("scale", 1)
    train, ev = _digits(scale)
    side = 8 * scale
    if name == "cnn":
        make = functools.partial(DigitsCNN, s["width"], side)
        what = f"3-block CNN (width {s['width']}) on {side}x{side} digits"
    else:
        make = functools.partial(DigitsMLP, side * side, s["hidden"])
        what = f"MLP (hidden {s['hidden']}) on {side}x{side} digits"
    return Workload(
        name,
        make,
        train,
        ev,
        _ce,
        accuracy,
        "accuracy",
        0.1,
        lr=s["lr"],
        batch_size=s["batch"],
        steps=s["steps"],
        size=size,
        description=what,  # the batch and steps are the run's: the report prints those
    )


def _lm_workload(size: str, device: str) -> Workload:
    # the text workload on first use: +155 ms to importing the workloads
    from mpnb.lab._text import VOCAB, TinyLM, generate_tokens, lm_sequences

    s = size_spec("transformer", size, device)
    seq, b = s["seq"], s["batch"]
    train = lm_sequences(generate_tokens(min(b * seq * s["steps"], 400_000) + 1, seed=0), seq)
    ev = lm_sequences(generate_tokens(max(4096, 8 * seq) + 1, seed=1), seq)
    heads = s.get("heads", max(1, s["d"] // 32))
    make = functools.partial(TinyLM, len(VOCAB), seq, s["d"], heads, s["layers"])
    return Workload(
        "transformer",
        make,
        train,
        ev,
        _flat_ce,
        accuracy,
        "next-token accuracy",
        1.0 / len(VOCAB),
        lr=s["lr"],
        batch_size=b,
        steps=s["steps"],
        size=size,
        description=(
            f"GPT ({s['layers']} layers, width {s['d']}, {heads} heads) on generated text, "
            f"{seq} tokens per sequence"
        ),
    )


def names() -> tuple[str, ...]:
    """The built-in workloads' names (the first is the default)."""
    return _BUILTIN


def get(workload: str | Workload, size: str | None = "auto", device: str = "cpu") -> Workload:
    """A built-in workload by name and size, or ``workload`` itself if it is a Workload.

    Args:
        workload: ``"transformer"``, ``"cnn"``, ``"mlp"`` or a :class:`Workload`.
        size: ``"small"``, ``"medium"``, ``"large"``, ``"gpu"`` or ``"auto"``
            (:func:`resolve_size`).
        device: for ``size="auto"`` and ``"gpu"`` (:func:`size_spec`).

    Example::

        >>> get("cnn", "small").description
        '3-block CNN (width 16) on 16x16 digits'
    """
    if isinstance(workload, Workload):
        return workload
    if workload not in _BUILTIN:
        raise ValueError(
            f"workload={workload!r} is unknown; built in: {', '.join(_BUILTIN)} "
            "(or pass mpnb.lab.workloads.custom(...), or a model factory and data to compare)."
        )
    size = resolve_size(size, device)
    if workload == "transformer":
        return _lm_workload(size, device)
    return _image_workload(workload, size, device)
