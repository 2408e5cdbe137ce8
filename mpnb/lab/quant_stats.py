"""``quant_stats``: per-layer quantization statistics of one training step of your model.

One forward and backward of a copy of the model under a precision configuration, inside
:func:`mpnb.core.fp8.stats.collect_quant_stats`: under a low-precision configuration
(``"nvfp4"``, ``"mxfp4"``, ``"mxfp8"``, ``"fp8-delayed"``...) the statistics of every operand
its recipe quantized; under any other (``"O0"``, ``"O1"``, ``"bf16-pure"``) with
``what_if="nvfp4"``, what that recipe would do to the same step's tensors. The result is a
:class:`~mpnb.core.fp8.stats.QuantStats` (``rows()``, ``heatmap()``, ``worst()``).

Example::

    >>> stats = mpnb.lab.quant_stats(model, x, "O1", what_if="nvfp4")
    >>> stats.worst("underflow_pct")          # the layer and tensor NVFP4 would hurt most
    >>> layers, tensors, values = stats.heatmap("rel_err")
"""

from __future__ import annotations

import copy
import warnings

import torch

from mpnb.core.amp import preserve_current_handle
from mpnb.core.fp8 import Float8Recipe, collect_quant_stats
from mpnb.core.fp8.recipes import RECIPES
from mpnb.core.fp8.stats import QuantStats
from mpnb.core.precision_configs import PrecisionConfig, get_config
from mpnb.lab._train import forward
from mpnb.lab.workloads import default_loss

__all__ = ["quant_stats"]


def _what_if_recipe(what_if):
    """A recipe for ``what_if``: a recipe (name or object) as is, or the recipe of a
    low-precision configuration (``"nvfp4-no-rht"``: NVFP4 without the RHT)."""
    if what_if is None or isinstance(what_if, Float8Recipe) or what_if in RECIPES:
        return what_if
    try:
        cfg = get_config(what_if)
    except ValueError:
        cfg = None
    make = getattr(cfg, "make_recipe", None)  # the configurations that train with a recipe
    if make is None:
        raise ValueError(
            f"quant_stats: what_if={what_if!r} names no number format recipe; use a recipe "
            f"({', '.join(RECIPES)}), a low-precision configuration such as 'nvfp4-no-rht' "
            "or 'mxfp4+sr+rht', or a recipe object (mpnb.fp8.recipe('nvfp4', rht=False))."
        )
    return make()


def quant_stats(
    model: torch.nn.Module,
    inputs,
    config: str | PrecisionConfig,
    *,
    what_if=None,
    loss_fn=None,
    half_dtype: torch.dtype | None = None,
) -> QuantStats:
    """One forward and backward of a copy of ``model`` under ``config``, measured.

    Args:
        model: the model (deep-copied; yours and its gradients are not changed).
        inputs: a tensor, a tuple of positional inputs or a dict of keyword inputs, on the
            model's device.
        config: a name of :data:`mpnb.core.precision_configs.PRECISION_CONFIGS` (or such an
            object). A low-precision one converts the copy's linear layers and is measured
            as it trains.
        what_if: None, a recipe name (``"nvfp4"``, ``"mxfp4"``...), a recipe object, or a
            low-precision configuration's name (``"nvfp4-no-sr"``): measure that format on
            the tensors of a ``config`` that does not convert the layers (``"O0"``, ``"O1"``).
        loss_fn: ``output -> scalar loss`` (default: mean of the squared float32 logits).
        half_dtype: the O levels' half dtype (default: bf16 on CPU, fp16 on CUDA).

    Returns:
        The :class:`~mpnb.core.fp8.stats.QuantStats` of the step. Under a loss-scaling
        configuration the gradients seen are the scaled ones (the recipes' statistics do not
        change under a power-of-two scale, except a delayed history's).

    Raises:
        ValueError: ``what_if`` with a configuration that already converts the layers, a
            model without linear layers, an unknown recipe (each names the fix).
    """

    cfg = get_config(config)
    rec = _what_if_recipe(what_if)
    if rec is not None and getattr(cfg, "make_recipe", None) is not None:
        raise ValueError(
            f"quant_stats: config {cfg.name!r} already quantizes the linear layers in its own "
            f"format, so what_if={what_if!r} has no unquantized tensors to measure. Drop "
            "what_if to see that format's statistics, or pass a configuration that keeps the "
            "layers in their precision ('O0', 'O1', 'bf16-pure') with what_if."
        )
    p = next(model.parameters(), None)
    if p is None:
        raise ValueError(
            f"quant_stats: {type(model).__name__} has no parameters, hence no linear layer to "
            "quantize; pass the model that owns the weights."
        )
    half = cfg.half_dtype(half_dtype, p.device)
    with preserve_current_handle():  # amp.initialize on the copy keeps the user's handle
        work = copy.deepcopy(model)
        opt = cfg.make_optimizer("sgd", work.parameters(), 0.0)  # never stepped
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the emulated-GEMM notes of a converted copy
            step = cfg.train_step(work, opt, half)
        try:
            with collect_quant_stats(step.module, what_if=rec) as stats:
                step.zero_grad()
                with step.forward_context(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    loss = (loss_fn or default_loss)(forward(step.model, inputs))
                step.backward(loss)
        finally:
            step.close()
    return stats
