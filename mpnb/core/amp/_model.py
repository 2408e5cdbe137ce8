"""What amp does to a model: cast its weights (O2/O3) and wrap its forward through hooks.

Forward wrapping uses only ``register_forward_pre_hook(with_kwargs=True)`` and
``register_forward_hook(always_call=True)``; ``model.forward`` is never replaced.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from mpnb.core.amp.casts import CastRegistry, _cast

__all__ = [
    "FSDP2_DTYPES",
    "ShardedModelError",
    "cast_model",
    "check_fp32",
    "check_model",
    "check_not_sharded",
    "CastForward",
    "AutocastForward",
    "model_device",
]


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for an empty model)."""
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def check_model(model: torch.nn.Module) -> None:
    """Refuse what amp cannot run: a model on the ``meta`` device, complex parameters."""
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.is_meta:
            raise ValueError(
                f"amp.initialize: {name!r} is on the meta device (shapes only, no data); "
                "materialize the model first (model.to_empty(device=...) and load or "
                "initialize its weights), then call amp.initialize."
            )
    for name, p in model.named_parameters():
        if p.is_complex():
            raise ValueError(
                f"amp.initialize: parameter {name!r} is {p.dtype}; amp's half dtypes and loss "
                "scaling are for real parameters. Store it as a real tensor (torch.view_as_real) "
                "or keep this model out of amp.initialize."
            )


_HALF = (torch.float16, torch.bfloat16)


def check_fp32(model: torch.nn.Module, opt_level: str) -> None:
    """Refuse a model whose params or buffers are already fp16/bf16, at every opt level.

    Apex's ``check_params_fp32`` rule: ``amp.initialize`` takes the fp32 model and makes the
    half copies itself. Handed a half model, O1 would train it in half with no fp32 weights
    (every update below half's resolution lost), and O2's fp32 masters would start from the
    rounded weights. ``cast_model_type=False`` (the caller skips this check) keeps the
    model's dtypes on purpose, where Apex's tests set ``allow_incoming_model_not_fp32``.
    """
    for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in items:
            if t.dtype in _HALF:
                raise ValueError(
                    f"amp.initialize: {kind} {name!r} is {t.dtype}; opt_level={opt_level!r} "
                    "takes an fp32 model and makes the half copies itself (O1 keeps fp32 "
                    "weights, O2 fp32 masters), so a model already in half would lose every "
                    "update below half's resolution. Pass the fp32 model (drop the .half() / "
                    ".to(torch.bfloat16) before amp.initialize; model.float() restores the "
                    "dtype, not the digits), or pass cast_model_type=False to keep its dtypes "
                    "on purpose."
                )


#: What amp's O1-O3 mean on a model FSDP2 shards: FSDP2's ``MixedPrecisionPolicy``
#: ``(param_dtype, reduce_dtype)``, bf16 compute with an fp32 gradient reduction (O3's pure
#: half reduces in bf16 too). The precision configurations pick their FSDP2 row from this.
FSDP2_DTYPES = {
    "O1": (torch.bfloat16, torch.float32),
    "O2": (torch.bfloat16, torch.float32),
    "O3": (torch.bfloat16, torch.bfloat16),
}


class ShardedModelError(ValueError):
    """amp O1-O3 refused on a model sharded by FSDP2, naming the ``MixedPrecisionPolicy``
    that does the same; a precision configuration rewords it with its policy's name.

    Attributes:
        opt_level: the refused opt level.
        param_dtype, reduce_dtype: the policy's dtypes (:data:`FSDP2_DTYPES`).
    """

    def __init__(self, opt_level: str):
        self.opt_level = opt_level
        self.param_dtype, self.reduce_dtype = FSDP2_DTYPES[opt_level]
        super().__init__(self.message())

    def policy_text(self) -> str:
        """``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=...)``."""
        return (
            f"MixedPrecisionPolicy(param_dtype={self.param_dtype}, "
            f"reduce_dtype={self.reduce_dtype})"
        )

    def message(self, policy_name: str | None = None) -> str:
        """The refusal and its fix; with ``policy_name``, the configuration to compare."""
        named = (
            f"the policy {policy_name!r} (compare(..., ranks=N, configs=[{policy_name!r}])), i.e. "
            if policy_name
            else ""
        )
        return (
            f"amp.initialize: opt_level {self.opt_level} on a model sharded by FSDP2 "
            "(fully_shard); amp casts whole parameters, FSDP2 holds 1/N shards. Use FSDP2's "
            f"mixed precision instead: {named}fully_shard(module, mp_policy="
            f"{self.policy_text()}) on each block and the root, with no amp.initialize "
            "(or opt_level='O0')."
        )


def check_not_sharded(model: torch.nn.Module, opt_level: str) -> None:
    """Refuse O1-O3 on a model sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``).

    FSDP2 keeps each parameter as a 1/N shard (a ``DTensor``) and all-gathers it for compute:
    O2/O3 cast parameters in place, under FSDP2's bookkeeping of the shards, and O1 casts per
    op after an fp32 all-gather, so the wire carries fp32 either way. FSDP2's own
    ``MixedPrecisionPolicy`` does what the opt level means on a sharded model (bf16
    all-gather and compute, fp32 reduction); the :class:`ShardedModelError` names the
    policy. O0 passes.
    """
    if opt_level == "O0":
        return
    try:
        # torch.distributed.fsdp: +690 ms to import, and absent from torch builds without it
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2 has no sharded models
        return
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return
    raise ShardedModelError(opt_level)


def cast_model(
    model: torch.nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool
) -> set[torch.dtype]:
    """Cast floating params and buffers to ``dtype`` in place, keeping Parameter identity.

    Batch norms (``_BatchNorm`` subclasses, SyncBatchNorm included) stay fp32 when
    ``keep_batchnorm_fp32``. Parameters keep their identity (``param.data`` is replaced), so
    an optimizer built before ``amp.initialize`` still holds them.

    Returns:
        The dtypes other than fp32 and ``dtype`` that params were cast from (a recast, e.g.
        an fp16 model made bf16), for the caller's warning.
    """
    recast: set[torch.dtype] = set()
    for mod in model.modules():
        if keep_batchnorm_fp32 and isinstance(mod, _BatchNorm):
            continue
        for p in mod.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != dtype:
                if p.dtype != torch.float32:
                    recast.add(p.dtype)
                p.data = p.data.to(dtype)
                if p.grad is not None:
                    p.grad = p.grad.to(dtype)
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                setattr(mod, name, b.to(dtype))
    return recast


class CastForward:
    """Hooks casting floating inputs to ``input_dtype`` and outputs to ``output_dtype``.

    Example::

        >>> CastForward(torch.bfloat16, torch.float32).attach(model)
    """

    def __init__(self, input_dtype: torch.dtype | None, output_dtype: torch.dtype | None):
        self.input_dtype, self.output_dtype = input_dtype, output_dtype

    def attach(self, model: torch.nn.Module) -> list:
        """Register the hooks on ``model``; returns their removable handles."""
        handles = []
        if self.input_dtype is not None:
            handles.append(model.register_forward_pre_hook(self._pre, with_kwargs=True))
        if self.output_dtype is not None:
            handles.append(model.register_forward_hook(self._post))
        return handles

    def _pre(self, module, args, kwargs):
        return _cast(args, self.input_dtype), _cast(kwargs, self.input_dtype)

    def _post(self, module, args, output):
        return _cast(output, self.output_dtype)


class AutocastForward:
    """O1: the model's forward runs inside ``torch.autocast(device_type, dtype)``.

    The pre-hook enters the region (and installs the registered cast functions); the forward
    hook, registered with ``always_call=True``, leaves it also when forward raises an
    ``Exception``. A stack makes re-entrant forwards safe.

    PyTorch runs ``always_call`` hooks for ``Exception`` only, so a ``KeyboardInterrupt``
    (Ctrl-C, or a notebook's "interrupt kernel") in the middle of forward leaves the region
    open: autocast would stay on for everything after it. Each open region remembers the
    frame of the call that entered it; the next forward closes the regions whose call is no
    longer running, and :meth:`close` (run by ``AmpHandle.remove_hooks``) closes them all.
    """

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype,
        registry: CastRegistry,
        output_dtype: torch.dtype | None = None,
    ):
        self.device_type, self.dtype, self.registry = device_type, dtype, registry
        self.output_dtype = output_dtype
        self._stack: list[tuple[contextlib.ExitStack, object]] = []  # (region, caller frame)

    def attach(self, model: torch.nn.Module) -> list:
        """Register the hooks on ``model``; returns their removable handles (removing the last
        one closes any region a KeyboardInterrupt left open)."""
        return [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._exit, always_call=True),
            _Closer(self.close),
        ]

    def close(self) -> None:
        """Close every open region, innermost first (autocast back to its state before)."""
        while self._stack:
            self._stack.pop()[0].close()

    def _close_stale(self) -> None:
        running = set()
        f = sys._getframe(2)
        while f is not None:
            running.add(id(f))
            f = f.f_back
        # Regions are nested: once the innermost's call still runs, so do the outer ones'.
        while self._stack and id(self._stack[-1][1]) not in running:
            self._stack.pop()[0].close()

    def _enter(self, module, args):
        if self._stack:  # a re-entrant forward, or a region an interrupt left open
            self._close_stale()
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(torch.autocast(self.device_type, dtype=self.dtype))
            stack.enter_context(self.registry.installed())
        except BaseException:
            stack.close()
            raise
        self._stack.append((stack, sys._getframe(1)))  # the call running this forward

    def _exit(self, module, args, output):
        if self._stack:
            self._stack.pop()[0].close()
        if self.output_dtype is not None:
            return _cast(output, self.output_dtype)
        return None


class _Closer:
    """A removable handle whose ``remove()`` runs ``fn`` (beside the hooks' own handles)."""

    def __init__(self, fn):
        self.remove = fn
