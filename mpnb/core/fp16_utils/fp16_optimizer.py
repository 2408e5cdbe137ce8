"""Apex's ``FP16_Optimizer``: fp32 masters for a half model, static or dynamic loss scaling.

The masters replace the half params inside the wrapped optimizer's ``param_groups``, and this
class exposes that optimizer's ``param_groups`` and ``state``, so LR schedulers work on it.
Host syncs: one per step, reading the overflow flag that the unscale pass wrote.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mpnb.core._numbers import positive_finite
from mpnb.core.amp.scaler import CollapseCheck
from mpnb.core.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler
from mpnb.core.ops import multi_tensor_scale

__all__ = ["FP16_Optimizer"]

_HALF = (torch.float16, torch.bfloat16)


class FP16_Optimizer(torch.optim.Optimizer):  # noqa: N801 (Apex's name)
    """Wrap ``init_optimizer`` built on a half model's params (Apex's ``FP16_Optimizer``).

    Args:
        init_optimizer: a ``torch.optim.Optimizer`` over the (half) model params.
        static_loss_scale: fixed scale when ``dynamic_loss_scale`` is False (a positive
            finite number).
        dynamic_loss_scale: use :class:`DynamicLossScaler`; after ``max_skips_at_min``
            (100) consecutive skipped steps at its floor scale 1 the step raises
            :class:`~mpnb.core.amp.LossScaleCollapseError`, as amp does.
        dynamic_loss_args: a dict of :class:`DynamicLossScaler`'s keywords (``init_scale``,
            ``scale_factor``, ``scale_window``, ``max_skips_at_min``); another key or form is
            refused with the valid keys, before ``init_optimizer`` changes.
        verbose: print a line when a step is skipped.

    ``state_dict()`` holds plain tensors and numbers only: it loads with ``torch.load``'s
    defaults (``weights_only=True``).

    Example::

        >>> opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
        ...                      dynamic_loss_scale=True)
        >>> opt.zero_grad(); opt.backward(loss); opt.clip_master_grads(1.0); opt.step()
    """

    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict | None = None,
        verbose: bool = True,
    ):
        # Deliberately no Optimizer.__init__: param_groups and state are the wrapped optimizer's.
        # The scaler first: its arguments are refused before init_optimizer's groups change.
        self.loss_scaler = (
            DynamicLossScaler.from_args(dynamic_loss_args)
            if dynamic_loss_scale
            else LossScaler(static_loss_scale)  # refuses a scale that is not positive and finite
        )
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise TypeError(
                "FP16_Optimizer: init_optimizer must be a torch.optim.Optimizer, got "
                f"{type(init_optimizer).__name__}."
            )
        self.optimizer = init_optimizer
        self.verbose = verbose
        self.fp16_groups, self.fp32_from_fp16_groups, self.fp32_from_fp32_groups = [], [], []
        for group in init_optimizer.param_groups:
            half, masters, fp32 = [], [], []
            for i, p in enumerate(group["params"]):
                if p.dtype in _HALF:
                    m = torch.nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
                    group["params"][i] = m
                    if p in init_optimizer.state:
                        init_optimizer.state[m] = init_optimizer.state.pop(p)
                    half.append(p)
                    masters.append(m)
                else:
                    fp32.append(p)
            self.fp16_groups.append(half)
            self.fp32_from_fp16_groups.append(masters)
            self.fp32_from_fp32_groups.append(fp32)
        self.dynamic_loss_scale = dynamic_loss_scale
        self.overflow = False
        self.first_closure_call_this_step = True
        self._flag = torch.zeros(1, dtype=torch.float32)
        halves = {p.dtype for g in self.fp16_groups for p in g}
        self._collapse = CollapseCheck(
            1.0,
            getattr(self.loss_scaler, "max_skips_at_min", None),
            halves.pop() if len(halves) == 1 else None,
            "pass dynamic_loss_args={'max_skips_at_min': None} to turn this check off",
            "DynamicLossScaler never goes below 1, and a scale of 1 amplifies nothing",
        )

    # ---- the wrapped optimizer's views (LR schedulers read and write these) -----------------

    @property
    def param_groups(self):
        """The wrapped optimizer's param groups (fp32 masters in place of half params)."""
        return self.optimizer.param_groups

    @property
    def state(self):
        """The wrapped optimizer's state."""
        return self.optimizer.state

    @property
    def defaults(self):
        """The wrapped optimizer's defaults."""
        return self.optimizer.defaults

    @property
    def loss_scale(self) -> float:
        """The current loss scale."""
        return self.loss_scaler.loss_scale

    def __repr__(self) -> str:
        return f"FP16_Optimizer({self.optimizer!r})"

    # ---- training -------------------------------------------------------------------------

    def zero_grad(self, set_grads_to_None: bool = False) -> None:  # noqa: N803
        """Zero (or drop) the grads of the masters and of the half model params."""
        for group in (*self.optimizer.param_groups, *({"params": g} for g in self.fp16_groups)):
            for p in group["params"]:
                if set_grads_to_None:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_().zero_()

    def backward(
        self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False
    ) -> None:
        """``(loss * scale).backward()``, then (by default) :meth:`update_master_grads`."""
        self.loss_scaler.backward(loss, retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscale model grads into the fp32 master grads in one pass, flagging overflow."""
        self._flag.zero_()
        inv = 1.0 / self.loss_scale
        for half, masters, fp32 in zip(
            self.fp16_groups, self.fp32_from_fp16_groups, self.fp32_from_fp32_groups, strict=True
        ):
            pairs = [(p, m) for p, m in zip(half, masters, strict=True) if p.grad is not None]
            for m in masters:
                if m.grad is None:
                    m.grad = torch.zeros_like(m)
            for dt in {p.dtype for p, _ in pairs}:
                sel = [(p, m) for p, m in pairs if p.dtype == dt]
                multi_tensor_scale(
                    self._flag, [p.grad.contiguous() for p, _ in sel], [m.grad for _, m in sel], inv
                )
            own = [p.grad for p in fp32 if p.grad is not None]
            for dt in {g.dtype for g in own}:
                g = [x for x in own if x.dtype == dt]
                multi_tensor_scale(self._flag, g, g, inv)
        self.overflow = self.dynamic_loss_scale and bool(self._flag.item())

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> float:
        """Clip the fp32 master grads; returns their norm, or -1 after an overflow (Apex's)."""
        if self.overflow:
            return -1
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type))

    def step(self, closure=None):
        """Step the masters and copy them into the model, or skip the step after an overflow."""
        if closure is not None:
            raise NotImplementedError(
                "FP16_Optimizer.step(closure) is not supported; call "
                "backward(loss) and step() instead."
            )
        scale = self.loss_scale
        self.loss_scaler.update_scale(self.overflow)
        if self.dynamic_loss_scale:
            self._collapse.limit = getattr(self.loss_scaler, "max_skips_at_min", None)
            self._collapse.note(self.overflow, scale)
        if self.overflow:
            if self.verbose:
                print(
                    f"OVERFLOW! Skipping step. Attempted loss scale: {scale}, reducing to "
                    f"{self.loss_scale}"
                )
            return None
        self.optimizer.step()
        with torch.no_grad():
            for half, masters in zip(self.fp16_groups, self.fp32_from_fp16_groups, strict=True):
                if half:
                    torch._foreach_copy_(half, masters)
        return None

    # ---- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Scaler, overflow state, the wrapped optimizer's state and the fp32 masters.

        Plain tensors, numbers and strings only (``torch.load(..., weights_only=True)``).
        """
        return {
            "loss_scaler": _scaler_state(self.loss_scaler),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": [[m.detach().clone() for m in g] for g in self.fp32_from_fp16_groups],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict` output (or an Apex checkpoint, whose scaler is an
        object); masters and model params take the saved values. Validated first: a bad
        checkpoint changes nothing."""
        scaler = _scaler_from(state_dict.get("loss_scaler"))
        saved = state_dict.get("fp32_from_fp16")
        shapes = [[m.shape for m in g] for g in self.fp32_from_fp16_groups]
        if (
            not isinstance(saved, list)
            or [
                [getattr(t, "shape", None) for t in g] if isinstance(g, list) else None
                for g in saved
            ]
            != shapes
        ):
            raise ValueError(
                "FP16_Optimizer.load_state_dict: the checkpoint's fp32 masters do not match this "
                "optimizer's params; load a checkpoint of the same model. Nothing was loaded."
            )
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        self.loss_scaler = scaler
        self.dynamic_loss_scale = bool(state_dict["dynamic_loss_scale"])
        self.overflow = bool(state_dict["overflow"])
        self.first_closure_call_this_step = bool(state_dict["first_closure_call_this_step"])
        with torch.no_grad():
            for cur, saved_group, half in zip(
                self.fp32_from_fp16_groups, saved, self.fp16_groups, strict=True
            ):
                for m, s, p in zip(cur, saved_group, half, strict=True):
                    m.copy_(s)
                    p.copy_(s)


_SCALER_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")


def _scaler_state(scaler) -> dict:
    out = {"dynamic": isinstance(scaler, DynamicLossScaler), "cur_scale": scaler.cur_scale}
    if out["dynamic"]:
        out.update({k: getattr(scaler, k) for k in _SCALER_KEYS[1:]})
        out["max_skips_at_min"] = scaler.max_skips_at_min
    return out


def _scaler_from(state) -> LossScaler:
    """A scaler from :func:`_scaler_state` output or an Apex-pickled scaler, validated."""
    if not isinstance(state, Mapping):  # Apex pickled the scaler object itself
        state = {k: getattr(state, k) for k in _SCALER_KEYS if hasattr(state, k)}
        state["dynamic"] = "scale_window" in state
    scale = positive_finite(
        state.get("cur_scale"),
        "loss_scaler['cur_scale']",
        owner="FP16_Optimizer.load_state_dict",
        fix="the checkpoint is corrupt. Nothing was loaded",
    )
    if not state.get("dynamic"):
        return LossScaler(scale)
    try:
        out = DynamicLossScaler(
            scale,
            state.get("scale_factor", 2.0),
            state.get("scale_window", 1000),
            state.get("max_skips_at_min", 100),
        )
    except ValueError as e:
        raise ValueError(f"FP16_Optimizer.load_state_dict: {e} Nothing was loaded.") from None
    for k in ("cur_iter", "last_overflow_iter"):
        v = state.get(k, 0 if k == "cur_iter" else -1)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(
                f"FP16_Optimizer.load_state_dict: loss_scaler[{k!r}]={v!r} is not an int; the "
                "checkpoint is corrupt. Nothing was loaded."
            )
        setattr(out, k, v)
    return out
