"""Casting control inside O1 (``torch.autocast``) regions.

``half_function`` / ``float_function`` / ``promote_function`` wrap a function so that, when it
is called inside an autocast region, its floating tensor arguments are cast (to the region's
half dtype, to fp32, or to the widest dtype among them) and it runs with autocast disabled.
Outside autocast they call the function unchanged.

``register_*_function(module, name)`` records a user-named function in a
:class:`CastRegistry`; O1 installs the wrapper as ``module.name`` only while a model's forward
runs (entered by a forward pre-hook, restored by a forward hook that also runs when forward
raises). This is the only place amp wraps a function someone else owns.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

__all__ = [
    "CastRegistry",
    "HandleCastMode",
    "default_registry",
    "disable_casts",
    "in_autocast_dtype",
    "half_function",
    "float_function",
    "promote_function",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
]

_DEVICE_TYPES = ("cpu", "cuda")


def _active_autocast() -> list[str]:
    return [d for d in _DEVICE_TYPES if torch.is_autocast_enabled(d)]


def _cast(obj, dtype):
    """``obj`` with every floating tensor cast to ``dtype``, its containers' types kept.

    Tensors, tuples, namedtuples (and ``torch.return_types``), lists, dicts (``OrderedDict``,
    ``defaultdict``, ...), dataclasses and Hugging Face ``ModelOutput`` (an ``OrderedDict``
    that is also a dataclass) come back as the same type; anything else is returned as is.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (str, bytes)) or obj is None:
        return obj
    if isinstance(obj, Mapping):  # before dataclasses: a ModelOutput's items are its fields
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _cast(v, dtype)
        return out
    if isinstance(obj, tuple):
        items = [_cast(o, dtype) for o in obj]
        if type(obj) is tuple:
            return tuple(items)
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        items = [_cast(o, dtype) for o in obj]
        if type(obj) is list:
            return items
        out = copy.copy(obj)
        out[:] = items
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, _cast(getattr(obj, f.name), dtype))
        return out
    return obj


def _widest(obj, found: list) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            found.append(obj.dtype)
    elif isinstance(obj, Mapping):
        for o in obj.values():
            _widest(o, found)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _widest(o, found)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _widest(getattr(obj, f.name), found)


class HandleCastMode(TorchFunctionMode):
    """The torch-function mode through which an ``amp.init`` handle casts per call.

    It lives here, below ``init_api`` (which subclasses it with the cast table), so that
    :func:`disable_casts` finds the active handles without importing ``init_api``.

    Args:
        handle: the handle; :func:`disable_casts` enters its ``_disable_casts()``.
    """

    def __init__(self, handle) -> None:
        super().__init__()
        self.handle = handle


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Turn autocast off for the body (every device where it is on), and the casts of any
    ``amp.init`` handle active in this thread; restored on exit.

    Example::

        >>> with amp.scale_loss(loss, opt) as scaled:   # inside an O1 forward...
        ...     with amp.disable_casts():
        ...         y = x.float() @ w.float()            # ...this matmul stays fp32
    """
    with contextlib.ExitStack() as stack:
        for dev in _active_autocast():
            stack.enter_context(torch.autocast(dev, enabled=False))
        for mode in _get_current_function_mode_stack():  # amp.init's casts (Apex's older API)
            if isinstance(mode, HandleCastMode):
                stack.enter_context(mode.handle._disable_casts())
        yield


def in_autocast_dtype(fn: Callable, *args):
    """``fn(*args)`` as Apex runs its fused functions: in the autocast region's dtype.

    Inside a ``torch.autocast`` region of the device of the first tensor argument, every
    floating tensor argument is cast to the region's dtype and ``fn`` runs with autocast off,
    so a fused op (which autocast knows nothing of) returns the region's dtype and its
    backward sees one dtype; outside a region, ``fn(*args)`` unchanged. (Apex's
    ``_cast_if_autocast_enabled`` plus ``autocast(enabled=False)``.)

    Example::

        >>> with torch.autocast("cpu", dtype=torch.float16):
        ...     y = in_autocast_dtype(layer_norm_op, x, weight, bias)   # fp16
    """
    dev = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
    if dev is None or not torch.is_autocast_enabled(dev):
        return fn(*args)
    args = _cast(args, torch.get_autocast_dtype(dev))
    with torch.autocast(dev, enabled=False):
        return fn(*args)


def _wrap(fn: Callable, policy: str) -> Callable:
    if getattr(fn, "_mpnb_cast_policy", None) is not None:
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        devices = _active_autocast()
        if not devices:
            return fn(*args, **kwargs)
        if policy == "half":
            dtype = torch.get_autocast_dtype(devices[0])
        elif policy == "float":
            dtype = torch.float32
        else:
            found: list = []
            _widest((args, kwargs), found)
            if not found:
                return fn(*args, **kwargs)
            dtype = functools.reduce(torch.promote_types, found)
        with disable_casts():
            return fn(*_cast(args, dtype), **_cast(kwargs, dtype))

    wrapper._mpnb_cast_policy = policy
    wrapper._mpnb_wrapped = fn
    return wrapper


def half_function(fn: Callable) -> Callable:
    """Decorator: inside O1 regions, run ``fn`` on half inputs (the region's dtype).

    Args:
        fn: any function taking tensors.

    Example::

        >>> @amp.half_function
        ... def fused_gelu(x): return torch.nn.functional.gelu(x)
    """
    return _wrap(fn, "half")


def float_function(fn: Callable) -> Callable:
    """Decorator: inside O1 regions, run ``fn`` in fp32 (inputs cast, autocast off).

    Example::

        >>> @amp.float_function
        ... def my_loss(a, b): return ((a - b) ** 2).mean()
    """
    return _wrap(fn, "float")


def promote_function(fn: Callable) -> Callable:
    """Decorator: inside O1 regions, cast inputs to the widest floating dtype among them.

    Example::

        >>> @amp.promote_function
        ... def add(a, b): return a + b
    """
    return _wrap(fn, "promote")


class CastRegistry:
    """User-named functions (``module.name``) to wrap while an O1 forward runs."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, str], tuple[object, str, str]] = {}

    def copy(self) -> CastRegistry:
        """A snapshot: ``amp.initialize`` keeps the functions registered before it (Apex)."""
        out = CastRegistry()
        out.entries = dict(self.entries)
        return out

    def register(self, module, name: str, policy: str) -> None:
        """Record ``module.name`` with ``policy`` (``"half"``, ``"float"``, ``"promote"``)."""
        if not hasattr(module, name):
            raise ValueError(
                f"amp.register_{policy}_function: {getattr(module, '__name__', module)!r} has no "
                f"attribute {name!r}; pass the module (or class) that defines it and its name."
            )
        if not callable(getattr(module, name)):
            raise ValueError(f"amp.register_{policy}_function: {name!r} is not callable.")
        self.entries[(id(module), name)] = (module, name, policy)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Install every wrapper for the body and put the originals back on exit (also on error)."""
        originals = []
        try:
            for module, name, policy in self.entries.values():
                # The raw attribute (a staticmethod stays a staticmethod when put back).
                raw = vars(module).get(name, getattr(module, name))
                originals.append((module, name, raw))
                wrapped = _wrap(getattr(module, name), policy)
                if isinstance(raw, (staticmethod, classmethod)):
                    wrapped = staticmethod(wrapped)
                setattr(module, name, wrapped)
            yield
        finally:
            for module, name, raw in reversed(originals):
                setattr(module, name, raw)


default_registry = CastRegistry()
"""Apex's module-level ``register_*_function`` calls record here (a compatibility surface);
each ``amp.initialize`` takes a snapshot of it, as Apex applies them at initialize."""


def register_half_function(module, name: str) -> None:
    """Run ``module.name`` on half inputs inside O1 forwards (Apex's ``register_half_function``).

    Example::

        >>> amp.register_half_function(torch, "bmm")
    """
    default_registry.register(module, name, "half")


def register_float_function(module, name: str) -> None:
    """Run ``module.name`` in fp32 inside O1 forwards.

    Example::

        >>> amp.register_float_function(torch.nn.functional, "softmax")
    """
    default_registry.register(module, name, "float")


def register_promote_function(module, name: str) -> None:
    """Run ``module.name`` on inputs cast to their widest dtype inside O1 forwards.

    Example::

        >>> amp.register_promote_function(torch, "add")
    """
    default_registry.register(module, name, "promote")
