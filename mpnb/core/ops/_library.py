"""The ``mpnb`` operator library: each op's schema, defined once, and the table of ops.

Every op family module (``scale.py``, ``adam.py``, ``layer_norm.py``...) calls :func:`define`
at import with the op's schema, its pure-PyTorch reference and its fake. That registers,
through ``torch.library`` and nothing else:

* the schema (``torch.ops.mpnb.<name>``);
* the reference as the ``CompositeExplicitAutograd`` kernel: it serves every device that has
  no kernel of its own (the CPU before the C++ library is loaded, or with
  ``MPNB_DISABLE_EXT=1``);
* for the CUDA key: our Triton kernel when a GPU run measured it at least PyTorch's speed or
  the user opted in (``MPNB_TRITON=1``), with a GPU and triton present
  (:mod:`mpnb.core.ops.triton`), else the PyTorch-ops path (PyTorch's own fused ops) when the
  family has one, else the reference;
* the fake (shape) kernel, and the autograd formula where the op is differentiable.

The C++ kernels register themselves for the CPU key (``TORCH_LIBRARY_IMPL(mpnb, CPU, m)`` at
the bottom of ``csrc/cpu/<family>.cpp``) when :func:`ensure_kernels` loads the library; from
then on the dispatcher picks them. There is no other path to an op.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from mpnb.core.ops import triton as _triton
from mpnb.core.ops._build import cpu_extension

__all__ = [
    "LIB",
    "OpInfo",
    "no_outputs",
    "Sample",
    "define",
    "all_ops",
    "op_info",
    "ensure_kernels",
    "kernels_loaded",
    "use_reference",
    "op_path",
]

#: The library that owns the ``mpnb`` namespace (schemas, references, fakes, autograd).
LIB = torch.library.Library("mpnb", "DEF")

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass
class Sample:
    """One call of an op for the tests: positional args (fresh tensors each time it is built)."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    name: str = ""


@dataclass(frozen=True)
class OpInfo:
    """One op: its schema and everything the dispatcher and the tests need to know about it.

    Attributes:
        name: the op's name in the ``mpnb`` namespace (``torch.ops.mpnb.<name>``).
        family: the module that defines it (``mpnb/core/ops/<family>.py``, and the kernel in
            ``csrc/cpu/<family>.cpp``).
        schema: the ``torch.library`` schema.
        reference: the pure-PyTorch implementation, with the op's signature.
        fake: the fake (meta) kernel.
        torch_path: PyTorch's own ops for CUDA (devices without a kernel of ours), or None.
        dtypes: the floating dtypes the op accepts (the tests sweep them).
        sample_inputs: ``sample_inputs(dtype) -> iterable of Sample``, for the parity tests.
        tolerance: ``{dtype: (rtol, atol)}`` of kernel vs reference (``(0, 0)``: bitwise).
        cpu_kernel: a C++ CPU kernel of ours exists.
    """

    name: str
    family: str
    schema: str
    reference: Callable
    fake: Callable
    torch_path: Callable | None = None
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    sample_inputs: Callable[[torch.dtype], Iterable[Sample]] | None = None
    tolerance: dict = field(default_factory=dict)
    cpu_kernel: bool = True

    @property
    def qualname(self) -> str:
        """``"mpnb::<name>"``."""
        return f"mpnb::{self.name}"

    @property
    def overload(self) -> torch._ops.OpOverload:
        """``torch.ops.mpnb.<name>.default``."""
        return getattr(torch.ops.mpnb, self.name).default


def no_outputs(*args, **kwargs) -> None:
    """The fake of an op that only writes into its arguments and returns nothing."""
    return None


_TABLE: dict[str, OpInfo] = {}
_TRITON_ON_CUDA: set[str] = set()  # ops whose CUDA kernel is our Triton kernel (opted in)


def define(
    schema: str,
    *,
    family: str,
    reference: Callable,
    fake: Callable,
    torch_path: Callable | None = None,
    autograd: tuple[Callable, Callable] | None = None,
    **info: Any,
) -> OpInfo:
    """Define one op from its schema and register its Python kernels; returns its :class:`OpInfo`.

    Args:
        schema: ``"name(args) -> returns"`` in ``torch.library``'s schema language.
        family: the defining module's short name.
        reference: the pure-PyTorch kernel (every device without a kernel of its own).
        fake: the fake kernel (shapes and dtypes of the outputs only).
        torch_path: PyTorch's own ops, registered for CUDA.
        autograd: ``(backward, setup_context)`` for a differentiable op.
        **info: the remaining :class:`OpInfo` fields (dtypes, sample_inputs, tolerance...).

    Example::

        >>> SCALE = define("my_scale(Tensor x, float s) -> Tensor", family="demo",
        ...                reference=lambda x, s: x * s, fake=lambda x, s: torch.empty_like(x))
    """
    name = schema.split("(", 1)[0].strip()
    LIB.define(schema)
    LIB.impl(name, reference, "CompositeExplicitAutograd")
    cuda = torch_path
    if _triton.triton_enabled(name):  # measured at least PyTorch's speed, or MPNB_TRITON=1
        cuda = _triton.launcher(name)
        _TRITON_ON_CUDA.add(name)
    if cuda is not None:
        LIB.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"mpnb::{name}", fake, lib=LIB)
    if autograd is not None:
        backward, setup_context = autograd
        torch.library.register_autograd(
            f"mpnb::{name}", backward, setup_context=setup_context, lib=LIB
        )
    op = OpInfo(name, family, schema, reference, fake, torch_path, **info)
    _TABLE[name] = op
    return op


def all_ops() -> list[OpInfo]:
    """Every defined op, in definition order (importing ``mpnb.core.ops`` defines them all)."""
    return list(_TABLE.values())


def op_info(name: str) -> OpInfo:
    """The :class:`OpInfo` of ``mpnb::name`` (KeyError naming the known ops otherwise)."""
    try:
        return _TABLE[name]
    except KeyError:
        raise KeyError(f"no mpnb op named {name!r}; known ops: {sorted(_TABLE)}") from None


_loaded = [False]  # one element: a module global read on every op call
_REFERENCE_ON_CPU: set[str] = set()  # ops use_reference() switched, while its block runs


def ensure_kernels() -> bool:
    """Build (on first use) and load the C++ kernels once; True when they are registered.

    Every op wrapper calls this before ``torch.ops.mpnb.<name>``; after the first call it is
    one list lookup. When the kernels cannot be built the references run (one warning).
    """
    if _loaded[0]:
        return True
    ok = cpu_extension().available()
    _loaded[0] = ok
    return ok


def kernels_loaded() -> bool:
    """True when the C++ kernels are loaded in this process (never builds or loads them)."""
    status = cpu_extension().status()
    return bool(status is not None and status.loaded)


@contextlib.contextmanager
def use_reference(names: Iterable[str] | None = None) -> Iterator[None]:
    """Run the pure-PyTorch references on the CPU inside the block, kernels or not.

    The references are registered for the CPU key in a temporary ``torch.library`` fragment
    that overrides the C++ kernels; leaving the block (also by an exception) destroys it and
    the C++ kernels are the CPU's kernels again. Tests use it to run a whole training step
    on the references; users can use it to check a suspected kernel bug.

    Args:
        names: the ops to switch (default: every op).

    Example::

        >>> with use_reference():
        ...     amp_step()          # every mpnb op runs its reference
    """
    ensure_kernels()  # load first: a later load would override the references again
    ops = all_ops() if names is None else [op_info(n) for n in names]
    lib = torch.library.Library("mpnb", "IMPL")
    switched = {op.name for op in ops} - _REFERENCE_ON_CPU
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered")
            for op in ops:
                lib.impl(op.name, op.reference, "CPU")
        _REFERENCE_ON_CPU.update(switched)
        yield
    finally:
        lib._destroy()
        _REFERENCE_ON_CPU.difference_update(switched)


def op_path(name: str, device: str = "cpu") -> str:
    """Which implementation a call of ``mpnb::name`` on ``device`` takes now, in words.

    Read off the dispatcher: a kernel registered for the device's key is ours (or
    PyTorch's ops on CUDA); otherwise the reference runs.
    """
    op = op_info(name)
    dev = torch.device(device).type
    ext = cpu_extension()
    if dev == "cuda":
        if name in _TRITON_ON_CUDA:
            return f"Triton kernel ({_triton.decision(name).label})"
        opt_in = f" (Triton kernel {_triton.decision(name).label})"
        has = name in _triton.LAUNCHERS
        if op.torch_path is not None:
            return "PyTorch's fused CUDA ops" + (opt_in if has else "")
        return "reference (PyTorch ops, no CUDA kernel)" + (opt_in if has else "")
    if dev != "cpu":
        return f"reference (no {dev} kernel)"
    if name in _REFERENCE_ON_CPU:
        return "reference (inside use_reference())"
    if not op.cpu_kernel:
        return "reference (no C++ kernel for this op)"
    if ext.disabled:
        return "reference (MPNB_DISABLE_EXT=1)"
    status = ext.status()
    if status is None:
        built = ext.is_built()
        return "C++ kernel (built, not loaded yet)" if built else "C++ kernel (built on first use)"
    if not status.loaded:
        return f"reference (build failed: {status.reason.splitlines()[0][:80]})"
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.qualname, "CPU"):
        return "C++ kernel (cpu)"
    return "reference (the library has no CPU kernel for this op)"
