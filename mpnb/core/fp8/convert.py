"""Swap a model's ``nn.Linear`` layers for :class:`Float8Linear` and back, in place.

Only modules whose type is exactly ``nn.Linear`` are swapped (a subclass may override
``forward``; ``nn.MultiheadAttention``'s ``out_proj`` is never called as a module), and
:class:`Float8Linear` layers of another recipe (a model converted twice takes the second
recipe). A keep-list (``keep=``, :class:`~mpnb.core.fp8.keep.KeepList`) names layers that
stay plain ``nn.Linear`` in the model's precision. The new layers share the old ones'
Parameter objects, so an optimizer built before the swap keeps working and the ``state_dict``
keys stay those of the original model (plus the delayed recipe's two buffers per layer).
Hooks registered on the old modules are not carried over. A converted model checks every
layer's FP8 state in a checkpoint before it loads any of it
(:meth:`Float8Linear.check_fp8_state`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch import nn

from mpnb.core.fp8.keep import KeepList
from mpnb.core.fp8.linear import Float8Linear
from mpnb.core.fp8.recipes import Float8Recipe
from mpnb.core.fp8.recipes import recipe as make_recipe

__all__ = [
    "convert_to_float8_training",
    "convert_from_float8_training",
    "float8_layers",
    "NoFloat8LayerWarning",
]


class NoFloat8LayerWarning(UserWarning):
    """``convert_to_float8_training`` left the model without any FP8 layer: it trains exactly
    as before (the lab's FP8 row of such a model says so in its ``warnings``)."""


def _why_none(model: nn.Module, filtered: bool, kept: int) -> str:
    """Why no layer of ``model`` is FP8 after the swap, and the fix (one warning's text)."""
    linear = sum(type(m) is nn.Linear for m in model.modules())
    subs = sorted(
        {type(m).__name__ for m in model.modules() if isinstance(m, nn.Linear)}
        - {"Linear", "Float8Linear"}
    )
    if linear and kept == linear:
        why = f"the keep-list kept all {linear} of its nn.Linear layers"
        fix = "Keep fewer layers (keep=None converts them all)"
    elif linear and filtered:
        why = f"module_filter_fn refused all {linear} of its nn.Linear layers"
        fix = "Check module_filter_fn: it gets (module, fqn) and returns True to convert"
    elif subs:
        why = (
            f"its Linear layers are subclasses of nn.Linear ({', '.join(subs)}), which are "
            "never swapped (a subclass may change forward)"
        )
        fix = "Use plain nn.Linear layers where FP8 should run"
    else:
        why = "the model has no nn.Linear layer (FP8 training converts nn.Linear layers only)"
        fix = (
            "Convert a model with nn.Linear layers (an MLP, a transformer); convolutions, "
            "embeddings and norms keep their precision"
        )
    return (
        f"convert_to_float8_training: no layer ran in FP8: {why}, so the model trains "
        f"exactly as before, in its own precision. {fix}."
    )


def _swap(model: nn.Module, make: Callable[[nn.Module, str], nn.Module | None]) -> nn.Module:
    """Replace every module for which ``make(module, fqn)`` returns a new one (shared once)."""
    done: dict[int, nn.Module] = {}

    def new_for(mod: nn.Module, fqn: str):
        if id(mod) not in done:
            done[id(mod)] = make(mod, fqn) or mod
        return done[id(mod)]

    root = new_for(model, "")
    if root is not model:
        return root
    # every (name, module) pair, shared modules included, listed before anything changes
    for fqn, mod in list(model.named_modules(remove_duplicate=False))[1:]:
        new = new_for(mod, fqn)
        if new is not mod:
            parent, _, name = fqn.rpartition(".")
            setattr(model.get_submodule(parent), name, new)
    return model


def convert_to_float8_training(
    model: nn.Module,
    recipe: Float8Recipe | str = "tensorwise",
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    *,
    keep: KeepList | str | None = None,
) -> nn.Module:
    """Swap the ``nn.Linear`` layers of ``model`` for FP8 ones (in place).

    A :class:`Float8Linear` of another recipe is converted too (its FP8 state starts fresh;
    the weight and bias stay the same Parameters); one of the same recipe is kept as it is.
    A layer the keep-list keeps stays (or becomes again) a plain ``nn.Linear``.

    Args:
        model: any module (if it is itself an ``nn.Linear``, a new module is returned).
        recipe: ``"tensorwise"``, ``"delayed"``, ``"rowwise"``, ``"mxfp8"`` or a recipe
            object (``mpnb.fp8.DelayedScaling(amax_history_len=16)``...).
        module_filter_fn: ``(module, fqn) -> bool``; only layers it accepts are swapped
            (for example, keep the classifier head in high precision).
        keep: a :class:`~mpnb.core.fp8.keep.KeepList` or anything :meth:`KeepList.of
            <mpnb.core.fp8.keep.KeepList.of>` takes (``"keep-last=2:keep=head"``, a list of
            module names or patterns): the layers that stay in the model's precision (the
            first / last N blocks, names, the head). Checked before anything changes: a
            name that matches no linear layer or more blocks than the model has raise
            ``ValueError``.

    Returns:
        ``model`` (the same object) with its linear layers swapped. When that leaves no FP8
        layer (no ``nn.Linear``, or ``module_filter_fn`` refused them all), a
        :class:`NoFloat8LayerWarning` says why: the model would train exactly as before.

    Example::

        >>> model = convert_to_float8_training(model, "delayed",
        ...                                    module_filter_fn=lambda m, fqn: fqn != "head")
        >>> opt = torch.optim.AdamW(model.parameters())   # or one built before: same params
        >>> convert_to_float8_training(model, "nvfp4", keep="keep-last=2")  # last 2 blocks fp32
    """
    rec = make_recipe(recipe)
    kept = set(KeepList.of(keep).kept(model))

    def make(mod, fqn):
        if fqn in kept:  # stays, or becomes again, the plain layer
            return mod.to_linear() if type(mod) is Float8Linear else None
        if type(mod) is Float8Linear and mod.recipe == rec:
            return None
        if type(mod) not in (nn.Linear, Float8Linear):
            return None
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            return None
        linear = mod.to_linear() if type(mod) is Float8Linear else mod
        return Float8Linear.from_linear(linear, rec, fqn or "(root)")

    out = _swap(model, make)
    if type(out) is not Float8Linear:  # a layer checks itself; a model checks all, first
        out.register_load_state_dict_pre_hook(_check_before_load)
        if not float8_layers(out):
            warnings.warn(
                _why_none(out, module_filter_fn is not None, len(kept)),
                NoFloat8LayerWarning,
                stacklevel=2,
            )
    return out


def _check_before_load(module, state_dict, prefix, *args) -> None:
    """Every FP8 layer's state in ``state_dict`` checked before any tensor is loaded."""
    for fqn, layer in float8_layers(module).items():
        layer.check_fp8_state(state_dict, f"{prefix}{fqn}.")


def convert_from_float8_training(model: nn.Module) -> nn.Module:
    """The inverse: every :class:`Float8Linear` back to an ``nn.Linear`` sharing its Parameters.

    The recipe state (amax histories, scales) is dropped; the result's ``state_dict`` loads
    into a model that was never converted.

    Example::

        >>> torch.save(convert_from_float8_training(model).state_dict(), "plain.pt")
    """
    return _swap(model, lambda mod, fqn: mod.to_linear() if type(mod) is Float8Linear else None)


def float8_layers(model: nn.Module) -> dict[str, Float8Linear]:
    """``{qualified name: layer}`` of the model's FP8 layers."""
    return {n: m for n, m in model.named_modules() if isinstance(m, Float8Linear)}
