"""Capabilities as data: every op mpnb compiles, with its reference, dtypes and fake kernel.

Each op family (``multi_tensor.py``, later optimizers and layers) calls :func:`register_op`
at import. ``mpnb doctor`` lists the table, the tests are parametrized over it, and the
dispatcher asks :func:`use_kernel` whether a call may take the compiled path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from operator import attrgetter

import torch

from mpnb.core.ops._build import cpu_extension

__all__ = [
    "OpInfo",
    "register_op",
    "register_fake",
    "all_ops",
    "kernel_ready",
    "use_kernel",
    "op_path",
    "op_caller",
    "read_grads",
    "any_grad",
    "unscale_grads",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class OpInfo:
    """One compiled op.

    Attributes:
        name: the op's name in the ``mpnb`` namespace (``torch.ops.mpnb.<name>``).
        family: the kernel family (``"multi_tensor"``, ``"optimizer"``, ``"layer"``...).
        reference: the pure-PyTorch implementation with the same signature.
        dtypes: the floating dtypes the kernel accepts.
        devices: devices with a compiled kernel of ours.
    """

    name: str
    family: str
    reference: Callable
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    devices: tuple[str, ...] = ("cpu",)
    doc: str = field(default="", compare=False)


_OPS: dict[str, OpInfo] = {}
_FAKES: dict[str, Callable] = {}
_AUTOGRAD: dict[str, tuple[Callable, Callable]] = {}
_fakes_applied = False


def register_op(info: OpInfo) -> OpInfo:
    """Add ``info`` to the table (idempotent for the same name)."""
    _OPS[info.name] = info
    return info


def register_fake(name: str) -> Callable[[Callable], Callable]:
    """Decorator: the fake (meta) kernel of ``mpnb::name``, installed once the library loads."""

    def wrap(fn: Callable) -> Callable:
        _FAKES[name] = fn
        if _fakes_applied:
            torch.library.register_fake(f"mpnb::{name}")(fn)
        return fn

    return wrap


def register_autograd(name: str, backward: Callable, setup_context: Callable) -> None:
    """The autograd formula of ``mpnb::name``, installed once the library loads.

    The ops exist only after the C++ library is loaded, so registration is deferred to
    :func:`kernel_ready`, like the fake kernels; a direct ``torch.ops.mpnb`` call made after
    that is differentiable too.
    """
    _AUTOGRAD[name] = (backward, setup_context)
    if _fakes_applied:
        torch.library.register_autograd(f"mpnb::{name}", backward, setup_context=setup_context)


def all_ops() -> list[OpInfo]:
    """Every registered op, in registration order."""
    return list(_OPS.values())


def kernel_ready() -> bool:
    """Build/load the CPU kernels if needed; True when ``torch.ops.mpnb`` may be called."""
    global _fakes_applied
    if not cpu_extension().available():
        return False
    if not _fakes_applied:
        _fakes_applied = True
        for name, fn in _FAKES.items():
            torch.library.register_fake(f"mpnb::{name}")(fn)
        for name, (backward, setup) in _AUTOGRAD.items():
            torch.library.register_autograd(f"mpnb::{name}", backward, setup_context=setup)
    return True


def _first_tensor(items: Iterable) -> torch.Tensor | None:
    for x in items:
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, (list, tuple)) and x:
            t = _first_tensor(x)
            if t is not None:
                return t
    return None


def use_kernel(*args) -> bool:
    """True when a call on these tensors (or lists of tensors) should take our kernel.

    Only the first tensor's device is looked at here (O(1) per call); the kernel checks every
    tensor itself and raises a clear error on a mix of devices.
    """
    t = args[0] if args and type(args[0]) is torch.Tensor else _first_tensor(args)
    if t is not None and not t.is_cpu:
        return False  # CUDA and others run PyTorch's own ops through the reference
    return kernel_ready()


def op_path(name: str, device: str = "cpu") -> str:
    """Which implementation a call of ``name`` on ``device`` takes now, in words."""
    info = _OPS[name]
    dev = torch.device(device).type
    ext = cpu_extension()
    if dev not in info.devices:
        return f"PyTorch ops on {dev} (no {dev} kernel of ours yet)"
    if ext.disabled:
        return "reference (MPNB_DISABLE_EXT=1)"
    status = ext.status()
    if status is None:
        return (
            "C++ kernel (built, not loaded yet)"
            if ext.is_built()
            else "C++ kernel (built on first use)"
        )
    if status.loaded:
        return f"C++ kernel ({dev})"
    return f"reference (build failed: {status.reason.splitlines()[0][:80]})"


_CALLERS: dict[str, Callable] = {}


_MODULE: list = []  # the loaded extension module, once known (a loaded .so stays loaded)


def _loaded_module():
    """The extension's Python module once the kernels are loaded (never loads them), or None."""
    if _MODULE:
        return _MODULE[0]
    status = cpu_extension().status()
    module = status.module if status is not None else None
    if module is not None:
        _MODULE.append(module)
    return module


def op_caller(name: str) -> Callable:
    """The function to call ``torch.ops.mpnb.<name>`` with, positional arguments only.

    ``torch.ops`` converts each argument through the generic JIT parser, about 90 ns per
    tensor: a fused step over 200 parameters passes 1,200 tensors. The extension's direct
    caller (``csrc/cpu/dispatch.cpp``) converts plain tensors with the CPython API and calls
    the same op through the dispatcher, so modes, fake tensors, autograd and the profiler see
    an ordinary call of ``mpnb::<name>``. It steps aside to ``torch.ops`` for tensor
    subclasses, an active TorchFunctionMode, while ``torch.compile`` traces, and whenever
    ``MPNB_DIRECT_CALL=0``. Call only after :func:`kernel_ready` returned True.
    """
    fn = _CALLERS.get(name)
    if fn is None:
        fn = _CALLERS[name] = _make_caller(name)
    return fn


def _make_caller(name: str) -> Callable:
    overload = getattr(torch.ops.mpnb, name).default
    module = _loaded_module()
    if module is None or not hasattr(module, "caller") or os.environ.get("MPNB_DIRECT_CALL") == "0":
        return overload
    direct = module.caller(name)
    if direct is None:  # an op without tensor lists: torch.ops is as fast
        return overload
    is_compiling = torch.compiler.is_compiling

    def call(*args):
        if not is_compiling():
            out = direct(*args)
            if out is not NotImplemented:
                return out
        return overload(*args)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"torch.ops.mpnb.{name}, called directly where that is equivalent."
    return call


_grad = attrgetter("grad")


def read_grads(params, drop_none: bool = False) -> list:
    """``[p.grad for p in params]`` (without the ``None``s when ``drop_none``), read in C++.

    Reading ``.grad`` from Python costs about 80 ns per ``nn.Parameter``; amp reads every
    grad before and after each backward. The extension's reader is used once the kernels are
    loaded (without loading them); otherwise this is the plain Python read.
    """
    module = _loaded_module()
    if module is not None and not torch.compiler.is_compiling():
        return module.grads(params, drop_none)
    if drop_none:
        return [g for g in map(_grad, params) if g is not None]
    return list(map(_grad, params))


def any_grad(params) -> bool:
    """True when some param of the list ``params`` has a ``.grad`` (read in C++ when loaded)."""
    module = _loaded_module()
    if module is not None and not torch.compiler.is_compiling():
        return module.any_grad(params)
    return any(g is not None for g in map(_grad, params))


def unscale_grads(
    params: list, found_inf: torch.Tensor, inv_scale: torch.Tensor, update: tuple | None = None
) -> bool:
    """``g *= inv_scale`` for every set ``.grad`` of ``params``, in one kernel call; inf/NaN
    raise ``found_inf``. With ``update`` (the arguments of
    :func:`mpnb.core.ops.update_loss_scale_` after ``found_inf``, in its order, with
    ``inv_scale`` left out: ``(scale, growth_tracker, hysteresis_tracker, growth_factor,
    backoff_factor, growth_interval, hysteresis, min_scale, max_scale)``) the loss-scale
    update follows in the same call.

    Returns False, having done nothing, where the caller's Python path must do the work: no
    kernels (not built, ``MPNB_DISABLE_EXT=1``), ``torch.compile`` tracing,
    ``MPNB_DIRECT_CALL=0``, grads that are not plain contiguous CPU tensors of one dtype.

    The grads are read in C++ and never become Python objects (about 80 ns each otherwise);
    both ops go through the dispatcher (``mpnb::multi_tensor_scale``,
    ``mpnb::update_loss_scale_``), so modes and the profiler see them.
    """
    if not kernel_ready() or torch.compiler.is_compiling():
        return False
    fn = _CALLERS.get("@unscale_grads")
    if fn is None:  # decided once, as op_caller decides for each op
        module = _loaded_module()
        off = module is None or os.environ.get("MPNB_DIRECT_CALL") == "0"
        fn = _CALLERS["@unscale_grads"] = _never if off else module.unscale_grads
    return fn(params, found_inf, inv_scale, update)


def _never(*args) -> bool:
    return False
