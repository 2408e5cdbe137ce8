"""Hugging Face ``transformers`` models in the lab, in one call.

:func:`transformers_workload` turns a model factory and token data into a
:class:`~mpnb.lab.workloads.Workload`: every batch is a dict passed as ``model(**batch)``
with ``labels``, the loss is the one the model computes from ``labels`` (:func:`hf_loss`),
and the metric is token (or class) accuracy from the logits (:func:`hf_accuracy`). Both read
any output form: a ``ModelOutput``, a plain dict, or a tuple (``return_dict=False``). The
``transformers`` package is needed only to build your model, not here.

Example::

    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    >>> ids = torch.randint(0, 64, (256, 32))
    >>> df = mpnb.lab.compare(transformers_workload(lambda: GPT2LMHeadModel(cfg), ids))
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.data import Dataset

from mpnb.lab.workloads import Workload, custom

__all__ = ["transformers_workload", "hf_loss", "hf_accuracy", "DictDataset"]


class DictDataset(Dataset):
    """Rows of a dict of equally long tensors; batches collate back into dicts.

    Example::

        >>> ds = DictDataset({"input_ids": ids, "labels": ids})
        >>> ds[0]["input_ids"].shape
    """

    def __init__(self, tensors: dict[str, torch.Tensor]):
        lens = {len(v) for v in tensors.values()}
        if len(lens) != 1:
            raise ValueError(f"DictDataset: the tensors differ in length {sorted(lens)}.")
        self.tensors = tensors

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.tensors.items()}


def _get(out, key: str):
    if hasattr(out, "keys"):  # ModelOutput or dict
        return out[key] if key in out.keys() else None
    return getattr(out, key, None)


def hf_loss(output, target=None) -> torch.Tensor:
    """The loss a ``transformers`` model computed from ``labels``, from any output form.

    Raises a ValueError naming the fix when the output holds no loss (no ``labels`` given).
    """
    loss = _get(output, "loss")
    if loss is None and isinstance(output, (tuple, list)) and output:
        first = output[0]
        loss = first if isinstance(first, torch.Tensor) and first.dim() == 0 else None
    if loss is None:
        raise ValueError(
            "hf_loss: the model output has no loss; pass labels in the batch (the "
            "transformers_workload batches do) or give your own loss_fn."
        )
    return loss


def _logits(output) -> torch.Tensor:
    logits = _get(output, "logits")
    if logits is None and isinstance(output, (tuple, list)):
        logits = next((t for t in output if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if logits is None:
        raise ValueError("hf_accuracy: the model output has no logits.")
    return logits


def hf_accuracy(output, labels: torch.Tensor, causal: bool = False) -> float:
    """Accuracy of the argmax of the logits; ``-100`` labels are ignored.

    Args:
        output: the model's output (``ModelOutput``, dict or tuple).
        labels: ``batch["labels"]``.
        causal: a causal LM predicts token ``t + 1`` at position ``t`` (the model shifts
            the labels for its loss; so does this).
    """
    pred = _logits(output).argmax(-1)
    if causal and pred.dim() >= 2:
        pred, labels = pred[..., :-1], labels[..., 1:]
    keep = labels != -100
    n = int(keep.sum())
    return float(((pred == labels) & keep).sum()) / n if n else float("nan")


def _is_causal(model_fn: Callable) -> bool:
    name = type(model_fn()).__name__
    return name.endswith("LMHeadModel") or "ForCausalLM" in name


def _as_dict_data(data, causal: bool):
    if isinstance(data, torch.Tensor):  # input_ids; a causal LM's labels are its inputs
        return DictDataset({"input_ids": data, "labels": data})
    if isinstance(data, dict):
        if "labels" not in data:
            if not causal:
                raise ValueError(
                    "transformers_workload: data has no 'labels'; add them (class ids "
                    "or token ids), or use a causal LM whose labels are its input_ids."
                )
            data = {**data, "labels": data["input_ids"]}
        return DictDataset(data)
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return DictDataset({"input_ids": data[0], "labels": data[1]})
    return data  # a DataLoader, Dataset or generator of dict batches


def transformers_workload(
    model_fn: Callable[[], torch.nn.Module],
    data,
    eval_data=None,
    *,
    causal: bool | None = None,
    name: str = "transformers model",
    lr: float = 1e-3,
    batch_size: int | None = None,
    steps: int = 40,
) -> Workload:
    """A workload for a Hugging Face model: loss from ``labels``, accuracy from the logits.

    Args:
        model_fn: returns a fresh model, e.g. ``lambda: GPT2LMHeadModel(GPT2Config(...))``
            (random weights: nothing is downloaded).
        data: ``input_ids`` (a causal LM learns to predict them), ``(input_ids, labels)``,
            a dict of tensors with ``input_ids``, ``labels`` (and e.g. ``attention_mask``),
            or a ``DataLoader``/``Dataset``/generator of such dict batches.
        eval_data: held-out data in the same forms (default: the first training batches).
        causal: whether labels are shifted for the metric (default: True for
            ``*LMHeadModel`` / ``*ForCausalLM`` classes, found by building one model).
        name, lr, batch_size, steps: as for :func:`mpnb.lab.workloads.custom`.

    Example::

        >>> w = transformers_workload(lambda: BertForSequenceClassification(cfg), (ids, y))
        >>> mpnb.lab.compare(w, configs=("O0", "O1"))
    """
    causal = _is_causal(model_fn) if causal is None else causal

    return custom(
        model_fn,
        _as_dict_data(data, causal),
        hf_loss,
        functools.partial(hf_accuracy, causal=causal),
        None if eval_data is None else _as_dict_data(eval_data, causal),
        name=name,
        metric_name="token accuracy" if causal else "accuracy",
        lr=lr,
        batch_size=batch_size,
        steps=steps,
    )
