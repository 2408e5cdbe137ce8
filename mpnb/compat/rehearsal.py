"""Rehearse a CUDA-only Apex script on a CPU: ``python -m mpnb.apex --cpu SCRIPT ARGS``.

An opt-in mode for CI and laptops, and the one place in mpnb that replaces torch functions: the
user asked for it, and everything is put back when the context exits, also when the script
raises. Inside :class:`CpuRehearsal`:

* ``.cuda()`` on tensors and modules, ``device="cuda"`` (or ``"cuda:N"``, ``torch.device``) in
  any torch call, ``.to("cuda")`` and ``pin_memory()`` place on the CPU. This part needs no
  replacement: a :class:`torch.overrides.TorchFunctionMode` rewrites the device arguments.
* ``torch.cuda.set_device``, ``synchronize``, ``manual_seed``/``manual_seed_all``, the device
  context ``torch.cuda.device(...)`` (and ``device_of``) and the stream calls (``Stream``,
  ``stream``, ``current_stream``, ``default_stream``, ``Event``) become no-ops (events time
  with the host clock, which is exact on the CPU's synchronous ops); ``current_device()`` is
  0 and ``device_count()`` 1 (``local_rank % device_count()`` picks device 0), and
  ``device=0`` (an int, a CUDA index) places on the CPU like ``device="cuda:0"``;
  ``mem_get_info()`` reports the host's free and total memory; ``cudart()``'s profiler
  start/stop do nothing.
* the legacy ``torch.cuda.FloatTensor``-style constructors build CPU tensors.
* ``torch.distributed.init_process_group`` / ``new_group`` with ``nccl`` use ``gloo``.

Each replacement is reported once on stderr, the first time the script uses it.

Example::

    >>> with CpuRehearsal():
    ...     x = torch.randn(4, device="cuda")   # a CPU tensor
    ...     torch.cuda.synchronize()            # nothing to wait for
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = ["CpuRehearsal", "REPLACED"]

_NOOPS = ("set_device", "synchronize", "manual_seed", "manual_seed_all")
_LEGACY = {
    "FloatTensor": torch.float32,
    "HalfTensor": torch.float16,
    "BFloat16Tensor": torch.bfloat16,
    "DoubleTensor": torch.float64,
    "IntTensor": torch.int32,
    "LongTensor": torch.int64,
    "ByteTensor": torch.uint8,
    "BoolTensor": torch.bool,
}
_STREAMS = ("Stream", "Event", "stream", "current_stream", "default_stream")

_DEVICE = ("device", "device_of", "current_device", "device_count", "mem_get_info", "cudart")

REPLACED: tuple[str, ...] = (
    *(f"torch.cuda.{n}" for n in (*_NOOPS, *_STREAMS, *_LEGACY, *_DEVICE)),
    "torch.cuda.memory.mem_get_info",
    "torch.distributed.init_process_group",
    "torch.distributed.new_group",
)
"""Every torch attribute :class:`CpuRehearsal` replaces (and restores on exit)."""


def _is_cuda(d) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d == "cuda" or d.startswith("cuda:")
    return False


class _Stream:
    """A CUDA stream stand-in on the CPU: every operation is already complete."""

    def __init__(self, *args, **kwargs) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, stream) -> None:
        """No-op: CPU ops are synchronous."""

    def wait_event(self, event) -> None:
        """No-op: CPU ops are synchronous."""

    def record_event(self, event=None):
        """Record ``event`` (a new one by default) now."""
        event = event or _Event()
        event.record()
        return event

    def synchronize(self) -> None:
        """No-op: CPU ops are synchronous."""

    def query(self) -> bool:
        """Always True: nothing is pending."""
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class _Event:
    """A CUDA event stand-in: records the host clock (exact for synchronous CPU ops)."""

    def __init__(self, *args, **kwargs) -> None:
        self._t: float | None = None

    def record(self, stream=None) -> None:
        """Remember the current time."""
        self._t = time.perf_counter()

    def wait(self, stream=None) -> None:
        """No-op: CPU ops are synchronous."""

    def synchronize(self) -> None:
        """No-op: CPU ops are synchronous."""

    def query(self) -> bool:
        """Always True: nothing is pending."""
        return True

    def elapsed_time(self, end: _Event) -> float:
        """Milliseconds between this event's record and ``end``'s."""
        if self._t is None or end._t is None:
            raise RuntimeError(
                "Event.elapsed_time: both events must be recorded first; call .record() on "
                "each before asking for the time between them."
            )
        return (end._t - self._t) * 1e3


class _DeviceContext:
    """``torch.cuda.device(...)`` / ``device_of(...)`` on the CPU: a context that changes
    nothing (there is one device)."""

    def __init__(self, device=None) -> None:
        self.idx = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class _CudaRT:
    """``torch.cuda.cudart()`` on the CPU: the profiler range calls Apex scripts make (no
    profiler to start)."""

    def cudaProfilerStart(self) -> int:  # noqa: N802 - CUDA's name
        """No-op; returns CUDA's success code."""
        return 0

    def cudaProfilerStop(self) -> int:  # noqa: N802 - CUDA's name
        """No-op; returns CUDA's success code."""
        return 0


def _host_memory() -> tuple[int, int]:
    """(free, total) bytes of the host's memory, the rehearsal's device memory."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


class _CpuPlacement(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to the CPU."""

    def __init__(self, report: Callable[[str], None]) -> None:
        super().__init__()
        self._report = report

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            self._report(".cuda() -> stays on the CPU")
            return args[0]
        if func is torch.Tensor.pin_memory:
            self._report(".pin_memory() -> no-op")
            return args[0]
        device = kwargs.get("device")
        if _is_cuda(device):
            self._report('device="cuda" -> device="cpu"')
            kwargs["device"] = "cpu"
        elif isinstance(device, int) and not isinstance(device, bool):
            self._report('device=N (a CUDA index, from torch.cuda.current_device()) -> "cpu"')
            kwargs["device"] = "cpu"
        if any(_is_cuda(a) for a in args):
            self._report('.to("cuda") -> .to("cpu")')
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


class CpuRehearsal:
    """Context manager: CUDA placement, CUDA-only calls and NCCL redirected to the CPU and gloo.

    Args:
        stream: where the one-line reports go (default ``sys.stderr``).

    Attributes:
        reported: the replacements used so far, in order (each reported once).

    Example::

        >>> with CpuRehearsal() as r:
        ...     model = torch.nn.Linear(2, 2).cuda()
        >>> r.reported
        ['.cuda() -> stays on the CPU']
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream
        self.reported: list[str] = []
        self._saved: list[tuple[object, str, object]] = []
        self._mode: _CpuPlacement | None = None

    # ---- reporting -------------------------------------------------------------------------

    def report(self, what: str) -> None:
        """Print ``what`` once to the stream (``mpnb.apex --cpu: ...``)."""
        if what in self.reported:
            return
        self.reported.append(what)
        print(f"mpnb.apex --cpu: {what}", file=self._stream or sys.stderr, flush=True)

    # ---- the replacements ------------------------------------------------------------------

    def _replace(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def _noop(self, name: str):
        def noop(*args, **kwargs):
            self.report(f"torch.cuda.{name}() -> no-op")

        noop.__name__ = name
        return noop

    def _stream_call(self, name: str):
        report = self.report
        what = f"torch.cuda.{name} -> CPU stand-in (no-op)"
        if name in ("Stream", "Event"):  # classes stay classes (isinstance keeps working)
            base = _Stream if name == "Stream" else _Event

            def init(obj, *args, **kwargs):
                report(what)
                base.__init__(obj, *args, **kwargs)

            return type(name, (base,), {"__init__": init, "__module__": __name__})

        def call(*args, **kwargs):
            report(what)
            if name == "stream":
                return contextlib.nullcontext(args[0] if args else None)
            return _Stream()

        call.__name__ = name
        return call

    def _device_call(self, name: str):
        what = f"torch.cuda.{name}"
        report = self.report
        if name in ("device", "device_of"):  # a class stays a class

            def init(obj, *args, **kwargs):
                report(f"{what}(...) -> no-op context (one device: the CPU)")
                _DeviceContext.__init__(obj)

            return type(name, (_DeviceContext,), {"__init__": init, "__module__": __name__})
        if name in ("current_device", "device_count"):
            value = 0 if name == "current_device" else 1

            def one_device() -> int:
                report(f"{what}() -> {value} (one device: the CPU)")
                return value

            one_device.__name__ = name
            return one_device

        if name == "cudart":

            def cudart() -> _CudaRT:
                report(f"{what}() -> profiler calls are no-ops")
                return _CudaRT()

            return cudart

        def mem_get_info(device=None) -> tuple[int, int]:
            report(f"{what}() -> the host's free and total memory")
            return _host_memory()

        return mem_get_info

    def _legacy(self, name: str, dtype: torch.dtype):
        def make(*args, **kwargs):
            self.report(f"torch.cuda.{name} -> a CPU tensor")
            if len(args) == 1 and isinstance(args[0], (list, tuple)):
                return torch.tensor(args[0], dtype=dtype)
            return torch.empty(*(args or (0,)), dtype=dtype)

        make.__name__ = name
        return make

    def _gloo(self, fn):
        sig = inspect.signature(fn)

        def call(*args, **kwargs):
            bound = sig.bind_partial(*args, **kwargs)
            backend = bound.arguments.get("backend")
            if isinstance(backend, str) and "nccl" in backend:
                self.report(f"torch.distributed.{fn.__name__}(backend='nccl') -> gloo")
                bound.arguments["backend"] = backend.replace("nccl", "gloo")
            return fn(*bound.args, **bound.kwargs)

        call.__name__ = fn.__name__
        return call

    # ---- enter / exit ----------------------------------------------------------------------

    def __enter__(self) -> CpuRehearsal:
        try:
            for n in _NOOPS:
                self._replace(torch.cuda, n, self._noop(n))
            for n in _STREAMS:
                self._replace(torch.cuda, n, self._stream_call(n))
            for n, dtype in _LEGACY.items():
                self._replace(torch.cuda, n, self._legacy(n, dtype))
            for n in _DEVICE:
                self._replace(torch.cuda, n, self._device_call(n))
            self._replace(torch.cuda.memory, "mem_get_info", torch.cuda.mem_get_info)
            self._replace(dist, "init_process_group", self._gloo(dist.init_process_group))
            self._replace(dist, "new_group", self._gloo(dist.new_group))
            self._mode = _CpuPlacement(self.report)
            self._mode.__enter__()
        except BaseException:
            self._restore()
            raise
        return self

    def _restore(self) -> None:
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)

    def __exit__(self, *exc) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
                self._mode = None
        finally:
            self._restore()
