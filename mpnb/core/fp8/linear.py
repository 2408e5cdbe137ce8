"""``Float8Linear``: an ``nn.Linear`` whose three GEMMs run in FP8 under a recipe.

Forward ``y = x W^T (+ b)``, backward ``dx = dy W`` and ``dW = dy^T x``: each GEMM gets its
operands quantized along its contraction dim by the layer's recipe (E4M3 input and weight,
E5M2 or E4M3 gradient) and runs in ``torch._scaled_mm`` where the device can, else the same
math emulated (one ``Float8FallbackWarning`` per layer and cause). The weight parameter stays
the high-precision master the optimizer updates; the bias is added after the GEMM in the
output dtype and its gradient is the high-precision sum of ``dy``.

What the backward keeps from the forward: per-tensor recipes the FP8 input and weight (one
byte per element; their quantization serves both backward GEMMs); rowwise and MX the input
quantized along the batch dim (for ``dW``) and the weight parameter (re-quantized along the
output dim for ``dx``).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from mpnb.core.fp8.gemm import fp8_mm, scaled_mm_blocker
from mpnb.core.fp8.recipes import RECIPES, Float8Recipe
from mpnb.core.fp8.recipes import recipe as make_recipe

__all__ = ["Float8Linear", "Float8FallbackWarning"]


class Float8FallbackWarning(UserWarning):
    """A layer's FP8 GEMM could not run in ``torch._scaled_mm`` and runs emulated instead.

    Attributes:
        layer: the layer's qualified name ("" when the warning is not a layer's).
        cause: the message without the layer's name, the same for every layer of one recipe
            and cause (what the lab's rows say once for all of them).
    """

    def __init__(self, message: str = "", layer: str = "", cause: str = "") -> None:
        super().__init__(message)
        self.layer, self.cause = layer, cause


def _autocast_on(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def _no_autocast(device_type: str):
    """Autocast off for the FP8 math (its dequantized matmul must stay float32)."""
    if not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


class _Float8Matmul(torch.autograd.Function):
    """``x @ weight.T`` with FP8 operands; gradients through FP8 GEMMs as well."""

    @staticmethod
    def forward(ctx, x, weight, layer, out_dtype):
        rec, update = layer.recipe, layer.training
        with _no_autocast(x.device.type):
            xq = layer.quantize_operand(x, "input", update, "forward")
            wq = layer.quantize_operand(weight, "weight", update, "forward")
            y = layer._gemm("forward", xq, wq, out_dtype, (x.shape[0], weight.shape[0]))
            if rec.per_tensor:
                ctx.operands = (xq, wq)
            else:
                x_cols = layer.quantize_operand(x.t(), "input", False, "grad_weight")
                ctx.operands = (x_cols, None)
                ctx.save_for_backward(weight)
        ctx.layer, ctx.update = layer, update
        ctx.dtypes = (x.dtype, weight.dtype)
        return y

    @staticmethod
    def backward(ctx, gy):
        layer = ctx.layer
        rec = layer.recipe
        xq, wq = ctx.operands
        gy = gy.contiguous()
        with _no_autocast(gy.device.type):
            g_rows = layer.quantize_operand(gy, "grad_output", ctx.update, "grad_input")
            if rec.per_tensor:
                w_cols, g_cols, x_cols = wq.t(), g_rows.t(), xq.t()
            else:
                (weight,) = ctx.saved_tensors
                w_cols = layer.quantize_operand(weight.t(), "weight", False, "grad_input")
                g_cols = layer.quantize_operand(gy.t(), "grad_output", False, "grad_weight")
                x_cols = xq
            gx = gw = None
            rows, cols = gy.shape[0], layer.in_features
            if ctx.needs_input_grad[0]:
                gx = layer._gemm("grad_input", g_rows, w_cols, ctx.dtypes[0], (rows, cols))
            if ctx.needs_input_grad[1]:
                shape = (layer.out_features, cols)
                gw = layer._gemm("grad_weight", g_cols, x_cols, ctx.dtypes[1], shape)
        return gx, gw, None, None


class Float8Linear(nn.Linear):
    """``nn.Linear`` training in FP8 (see :mod:`mpnb.core.fp8.linear`).

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        recipe: a :class:`~mpnb.core.fp8.recipes.Float8Recipe` or its name (default
            ``"tensorwise"``).
        fqn: the layer's qualified name in its model, used in warnings
            (:func:`convert_to_float8_training` sets it).

    The output dtype is the input's, or the autocast dtype inside ``torch.autocast``. The
    layer's ``state_dict`` has ``weight`` and ``bias`` as ``nn.Linear`` plus the recipe's
    buffers (``DelayedScaling``: ``fp8_amax_history``, ``fp8_scale``); loading a checkpoint
    without them (from a plain ``nn.Linear``) starts the recipe state fresh, and one whose
    values are corrupt is refused (:meth:`check_fp8_state`).

    Example::

        >>> layer = Float8Linear(64, 32, recipe="delayed")
        >>> layer(torch.randn(16, 64)).sum().backward()
        >>> layer.fp8_amax_history[0]        # this step's amax of input, weight, grad_output
    """

    #: a callable ``(layer, t, role, gemm, operand)`` that sees every operand this layer
    #: quantizes, after the recipe made it; None (the class default) calls nothing.
    #: :func:`mpnb.core.fp8.stats.collect_quant_stats` sets it on a model's layers while it
    #: collects and removes it after.
    quant_observer = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        recipe: Float8Recipe | str = "tensorwise",
        fqn: str = "",
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self._setup(recipe, fqn)

    def _setup(self, rec, fqn: str) -> None:
        self.recipe = make_recipe(rec)
        self.fqn = fqn
        self._fp8_warned: set[str] = set()
        self.recipe.init_state(self)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe, fqn: str = "") -> Float8Linear:
        """A ``Float8Linear`` sharing ``linear``'s weight and bias Parameters (same objects).

        An optimizer built on the model before the swap keeps updating the same tensors.
        """
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.register_parameter("bias", linear.bias)
        new.train(linear.training)
        new._setup(recipe, fqn)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` sharing this layer's weight and bias (recipe state dropped)."""
        lin = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(lin)
        lin.in_features, lin.out_features = self.in_features, self.out_features
        lin.weight = self.weight
        lin.register_parameter("bias", self.bias)
        lin.train(self.training)
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b`` through FP8 GEMMs; ``x`` of any shape ``(..., in_features)``."""
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"Float8Linear {self.fqn or '(unnamed)'}: input has {x.shape[-1]} features in "
                f"its last dim, the layer expects in_features={self.in_features}."
            )
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if _autocast_on(dev) else x.dtype
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:  # no rows: nothing to quantize, an empty product
            y = (x2 @ self.weight.t().to(x2.dtype)).to(out_dtype)
        else:
            y = _Float8Matmul.apply(x2, self.weight, self, out_dtype)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def quantize_operand(self, t: torch.Tensor, role: str, update: bool, gemm: str):
        """``self.recipe.quantize(self, t, role, update, gemm=gemm)``, shown to
        :attr:`quant_observer` when one is set (with none, nothing else runs)."""
        q = self.recipe.quantize(self, t, role, update, gemm=gemm)
        if self.quant_observer is not None:
            self.quant_observer(self, t, role, gemm, q)
        return q

    def _gemm(self, which: str, a, b, out_dtype: torch.dtype, shape) -> torch.Tensor:
        blocker = scaled_mm_blocker(a, b, out_dtype)
        if blocker is not None and blocker[0] != "speed":
            self._warn_fallback(which, *blocker)
        y = fp8_mm(a, b, out_dtype, scaled_mm=blocker is None)
        # a recipe that pads its operands to whole blocks (the four-bit ones): cut back
        return y if tuple(y.shape) == tuple(shape) else y[: shape[0], : shape[1]].contiguous()

    def _warn_fallback(self, which: str, category: str, reason: str) -> None:
        if category in self._fp8_warned:
            return
        self._fp8_warned.add(category)
        layer = self.fqn or "(unnamed Float8Linear)"
        where = f"mpnb.fp8: layer {layer!r} ({self.recipe.label})"
        how = (
            f"its {which} GEMM: {reason}. Same numerics as the FP4 GEMM, no FP4 speed-up."
            if category == "fp4"
            else f"its {which} GEMM cannot run in torch._scaled_mm: {reason}. It runs the same "
            "FP8 math emulated (dequantized operands, float32 matmul): same numerics, no FP8 "
            "speed-up."
        )
        warnings.warn(
            Float8FallbackWarning(
                f"{where}: {how} Shown once per layer and cause.",
                layer=layer,
                cause=f"({self.recipe.label}): {how}",
            ),
            stacklevel=3,
        )

    def check_fp8_state(self, state_dict, prefix: str = "") -> None:
        """Raise ValueError, changing nothing, if ``state_dict`` holds FP8 state this layer
        cannot take (under ``prefix``): another recipe's state (a ``"delayed"`` checkpoint's
        amax history in an ``"mxfp8"`` layer), a scale that is not finite and positive, or an
        amax history with a negative, inf or NaN entry (the next forward would be all NaN, or
        its scale frozen). A checkpoint without the entries (a plain ``nn.Linear``) passes."""
        self._check_recipe_of(state_dict, prefix)
        bad = []
        for name, ok, rule in (
            ("fp8_scale", lambda t: torch.isfinite(t) & (t > 0), "finite and > 0"),
            ("fp8_amax_history", lambda t: torch.isfinite(t) & (t >= 0), "finite and >= 0"),
        ):
            t = state_dict.get(prefix + name)
            if name not in self._buffers or t is None:
                continue
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                bad.append(f"{prefix}{name} is a {type(t).__name__}, not a floating tensor")
                continue
            wrong = ~ok(t.detach().float())
            if wrong.any():
                first = t.detach().flatten()[wrong.flatten()][:3].tolist()
                n = int(wrong.sum())
                bad.append(f"{prefix}{name} has {n} value(s) like {first} (must be {rule})")
        if bad:
            raise ValueError(
                f"Float8Linear {self.fqn or '(unnamed)'!r}: the checkpoint's FP8 state is corrupt: "
                f"{'; '.join(bad)}. Nothing was loaded. Load a checkpoint of a healthy run, or "
                f"drop this layer's '{prefix}fp8_amax_history' and '{prefix}fp8_scale' entries "
                "to start its FP8 state fresh."
            )

    def _check_recipe_of(self, state_dict, prefix: str) -> None:
        """Refuse a checkpoint holding the state of a recipe other than this layer's."""
        own = type(self.recipe)
        for cls in RECIPES.values():
            found = [prefix + n for n in cls.state_names if prefix + n in state_dict]
            if cls is own or not found or all(n in self._buffers for n in cls.state_names):
                continue
            where = self.fqn or prefix.rstrip(".") or "(unnamed)"
            raise ValueError(
                f"Float8Linear {where!r}: the checkpoint holds {', '.join(found)}, the state of "
                f"the {cls.name!r} recipe, but this layer trains with {self.recipe.label!r}. "
                "Nothing was loaded. To resume the checkpoint's FP8 training, build the layer "
                f"with recipe={cls.name!r} (convert_to_float8_training(model, {cls.name!r})); "
                f"to load its weights into this {self.recipe.name} layer, drop those entries "
                "from the state dict first."
            )

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        self.check_fp8_state(state_dict, prefix)
        own = [prefix + n for n, _ in self.named_buffers(recurse=False)]
        absent = [k for k in own if k not in state_dict]
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )
        if absent and len(absent) == len(own):  # a plain nn.Linear checkpoint: fresh FP8 state
            for k in absent:
                if k in missing_keys:  # listed only when strict
                    missing_keys.remove(k)
            self.recipe.reset_state(self)
        self.recipe.after_load(self)

    def extra_repr(self) -> str:
        """``nn.Linear``'s description plus the recipe."""
        return f"{super().extra_repr()}, recipe={self.recipe!r}"
