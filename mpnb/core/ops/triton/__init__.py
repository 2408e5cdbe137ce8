"""GPU kernels of mpnb in Triton: the CUDA backend of the ``mpnb::`` ops, on by default only
where a GPU run measured them at least as fast as PyTorch's own CUDA path.

One module per op family, named like the op's module (``adam.py``, ``sgd.py``, ``lamb.py``,
``scale.py``, ``l2norm.py``, ``layer_norm.py``, ``rms_norm.py``, ``softmax.py``,
``rotary.py``). Each exposes one launcher per op, named like the op, taking the op's call as
one object (``args``, the named tuple of its reference's parameters: ``args.lr``), and
launches its kernels by keyword, the kernels' parameters named as the op's arguments wherever
they are one (``scale``, ``noop_flag``; a list's carrier tensor by the list's name; a bool
switch in capitals, ``PER_TENSOR``; ``HAS_INV_SCALE`` for an optional tensor given;
``eps_hi``/``eps_lo`` for a float's two fp32 halves). An op says which module holds its
launcher where it is defined (``define(..., triton="adam")``, :mod:`mpnb.core.ops._library`),
which registers the launcher, behind the op's checks, for the CUDA key of the op and
records it here (:func:`register`: the library imports this package, never the reverse);
:data:`LAUNCHERS` lists them, and :func:`launcher` gives one as the dispatcher calls it
(positional, the reference's order)::

    from mpnb.core.ops import triton as tk

    scale = tk.launcher("multi_tensor_scale")     # scale(flag, src, dst, 0.5)

Importing this package imports neither triton nor the kernels (it must stay importable where
triton is not installed); :func:`launcher` imports a kernel module on first use.

Which kernels serve CUDA calls is data: ``measured.json`` holds each kernel's ratio to
PyTorch's path as measured by ``scripts/gpu-check.sh`` (:mod:`._decision`), with its 95%
interval. A kernel whose interval's lower end is at least 1.0 (at least PyTorch's speed, with
confidence) is on by default; the others, and those measured without an interval, are opt-in,
and ``mpnb doctor`` shows their ratio and interval. ``MPNB_TRITON=1`` switches every kernel
on, ``MPNB_TRITON=0`` every kernel off (read once, :func:`triton_status`).

Tensor-list launchers read their tensors through a table of addresses (one launch per list),
which ``torch.compile`` cannot see into: they are registered as opaque ops
(``torch.library.impl``), not through ``torch.library.triton_op``. The layer launchers (norms,
softmax, RoPE) pass every tensor to the kernel.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from mpnb.core.ops.triton._decision import TritonDecision, decide, kernel_source, load_table

__all__ = [
    "LAUNCHERS",
    "TritonDecision",
    "TritonStatus",
    "decision",
    "enabled_for",
    "launcher",
    "probe_triton",
    "register",
    "triton_enabled",
    "triton_status",
    "triton_usable",
]


#: op name -> ``"<module>:<function>"``, filled by :func:`register` (the op library, as it
#: defines each op); :data:`LAUNCHERS` is its read-only view
_LAUNCHERS: dict[str, str] = {}
#: op name -> the op's ``triton_kernel`` (its launcher behind its checks, imported when called)
_KERNELS: dict[str, Callable[[], Callable]] = {}

#: The ops with a Triton kernel: ``{op name: "<module>:<function>"}``, in definition order
#: (complete once :mod:`mpnb.core.ops`, the parent of this package, is imported).
LAUNCHERS: Mapping[str, str] = MappingProxyType(_LAUNCHERS)


def register(name: str, module: str, kernel: Callable[[], Callable]) -> None:
    """Record that op ``name`` has a Triton launcher, ``<module>.<name>`` in this package;
    ``kernel()`` gives it as the dispatcher calls it. The op library calls this as it defines
    the op (:func:`~mpnb.core.ops._library.define`): the library knows this package, not the
    other way round, so this package imports nothing of the ops.

    Example::

        >>> register("multi_tensor_scale", "scale", op.triton_kernel)
    """
    _LAUNCHERS[name] = f"{module}:{name}"
    _KERNELS[name] = kernel


def launcher(name: str) -> Callable:
    """The Triton launcher of op ``name`` as the dispatcher calls it: positional, in the
    reference's order, behind the op's checks (imports triton and the kernel module).

    Raises:
        KeyError: ``name`` has no Triton kernel (the message lists those that do).
        ImportError: triton cannot be imported here.

    Example::

        >>> launcher("multi_tensor_scale")(flag, src, dst, 0.5)
    """
    kernel = _KERNELS.get(name)
    if kernel is None:
        raise KeyError(f"no Triton kernel for op {name!r}; ops with one: {', '.join(LAUNCHERS)}.")
    return kernel()


@dataclass(frozen=True)
class TritonStatus:
    """Whether the Triton kernels may serve CUDA calls here, and why not.

    Attributes:
        mode: ``"measured"`` (the default: the kernels whose interval's lower end is at
            least PyTorch's speed),
            ``"all"`` (``MPNB_TRITON=1``) or ``"off"`` (``MPNB_TRITON=0``).
        cuda: torch sees a CUDA device.
        version: triton's version, or None when it cannot be imported (or was not tried).
        reason: why no kernel is used, in words ("" when some may be).
    """

    mode: str
    cuda: bool
    version: str | None
    reason: str

    @property
    def opted_in(self) -> bool:
        """``MPNB_TRITON=1``: every kernel, measured or not."""
        return self.mode == "all"

    @property
    def usable(self) -> bool:
        """True when every condition holds (then :func:`triton_enabled` decides per op)."""
        return not self.reason


def probe_triton(
    environ: Mapping[str, str] | None = None,
    cuda_available: Callable[[], bool] | None = None,
    table: Mapping | None = None,
) -> TritonStatus:
    """Check the conditions now: a kernel to use (by the table or ``MPNB_TRITON=1``), a CUDA
    device, triton importable.

    Args:
        environ: the environment to read ``MPNB_TRITON`` from (default ``os.environ``).
        cuda_available: the CUDA check (default ``torch.cuda.is_available``).
        table: the measured table (default: the committed one, :func:`decision`).

    Conditions are checked in that order and triton is imported only when the first two
    hold, so the probe stays cheap where the kernels cannot run.
    """
    env = os.environ if environ is None else environ
    flag = env.get("MPNB_TRITON", "")
    mode = {"1": "all", "0": "off"}.get(flag, "measured")
    if cuda_available is None:
        cuda_available = torch.cuda.is_available
    cuda = bool(cuda_available())
    if mode == "off":
        return TritonStatus(mode, cuda, None, "switched off by MPNB_TRITON=0")
    if mode == "measured":
        measured = load_table() if table is None else table
        kernels = measured.get("kernels", {})
        if not any(decide(n, measured, _source(n)).default for n in kernels):
            why = (
                "opt-in: no kernel has measured at least PyTorch's speed on a GPU with the "
                "lower end of its 95% interval (a ratio recorded without an interval counts "
                "as unmeasured); run scripts/gpu-check.sh on the card to measure them, or set "
                "MPNB_TRITON=1 to use them all"
            )
            return TritonStatus(mode, cuda, None, why)
    if not cuda:
        return TritonStatus(mode, False, None, "no CUDA device: the Triton kernels need a GPU")
    try:
        import triton  # optional (Linux wheels only), and imported only beside a CUDA device
    except ImportError as e:
        where = (
            ""
            if sys.platform == "linux"
            else f" (triton ships wheels for Linux only; this is {sys.platform})"
        )
        return TritonStatus(
            mode, True, None, f"triton cannot be imported ({e}){where}: pip install triton"
        )
    return TritonStatus(mode, True, triton.__version__, "")


@functools.cache
def _table() -> dict:
    return load_table()


def decision(name: str) -> TritonDecision:
    """Op ``name``'s Triton kernel: on by default or opt-in, from the committed measurements.

    Example::

        >>> decision("rope").label
        'opt-in (MPNB_TRITON=1), unmeasured on a GPU'
    """
    return decide(name, _table(), _source(name))


def _source(name: str) -> str | None:
    """Today's :func:`kernel_source` of op ``name``'s kernel module (None: no launcher known)."""
    where = _LAUNCHERS.get(name)
    return None if where is None else _module_source(where.split(":")[0])


@functools.cache
def _module_source(module: str) -> str:
    return kernel_source(module)


@functools.cache
def triton_status() -> TritonStatus:
    """:func:`probe_triton` of this process, computed once (``MPNB_TRITON`` is read once)."""
    return probe_triton(table=_table())


def triton_usable() -> bool:
    """True when Triton kernels may serve CUDA calls here (a GPU, triton, something to use)."""
    return triton_status().usable


def enabled_for(name: str) -> bool:
    """True when a Triton kernel of op ``name`` would serve its CUDA calls: usable here, and
    on by default (its interval's lower end at least PyTorch's speed) or switched on by
    ``MPNB_TRITON=1`` (what :func:`~mpnb.core.ops._library.define` asks of an op that has one)."""
    status = triton_status()
    return status.usable and (status.opted_in or decision(name).default)


def triton_enabled(name: str) -> bool:
    """True when op ``name``'s CUDA calls run its Triton kernel: it has one
    (:data:`LAUNCHERS`) and :func:`enabled_for` holds."""
    return name in LAUNCHERS and enabled_for(name)
