"""Count the host reads of device values in a block of code: each one makes a CUDA host wait.

A training step that reads a device value on the host (``loss.item()``, ``bool(found_inf)``,
``scale.tolist()``, a blocking copy to the CPU) waits there until the GPU has computed it; while
it waits it queues nothing, so the GPU idles once the queue drains. :class:`HostReads` counts
those reads while code runs, on any device, so a CPU run (and a test) can say how often the same
code would wait on a GPU:

* ``Tensor.item()`` and ``Tensor.tolist()`` called from Python anywhere, also inside an op's
  Python kernel (seen by wrapping the two methods while a counter is open, for the threads
  that opened one: ``tolist`` reads a CPU tensor without dispatching an op);
* ``aten::_local_scalar_dense``, the op behind ``bool()``, ``int()``, ``float()`` and
  ``if tensor:`` (seen through a :class:`~torch.utils._python_dispatch.TorchDispatchMode`,
  also when PyTorch's own code calls it); the mode does not see inside an op whose kernel is
  Python (a mode is off while it handles an op), where only ``item`` and ``tolist`` count;
* a copy between a CUDA tensor and host memory that is not ``non_blocking`` (``aten::_to_copy``
  and ``aten::copy_``): to the host it waits for the value; to the device, from pageable
  memory, PyTorch synchronizes the stream after it, so the host waits there too.

``Tensor.numpy()`` is not counted: it works on host memory only (a pinned host buffer filled by
an asynchronous copy, read once its event has completed, which never waits).

On CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` reports the synchronizations themselves; the
GPU check uses both and compares them.

Example::

    >>> with HostReads() as reads:
    ...     train_step()
    >>> reads.count, reads.where[:1]
    (0, [])
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReads"]

_SCALAR = torch.ops.aten._local_scalar_dense.default
_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
_HERE = __file__


def _device_of(x) -> torch.device | None:
    return x.device if isinstance(x, torch.Tensor) else None


def _blocking_copy(func, args, kwargs) -> bool:
    """True for a copy between a CUDA tensor and host memory that makes the host wait: to the
    host always, to the device from pageable memory (a 0-dim CPU tensor used in a CUDA op is
    read as a scalar, with no copy: that one is not seen here)."""
    if kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True):
        return False
    if func is _COPIES[0]:
        src, dst = args[0], kwargs.get("device")
    else:
        dst, src = args[0], args[1] if len(args) > 1 else None
    s, d = _device_of(src), dst.device if isinstance(dst, torch.Tensor) else dst
    if s is None or d is None or torch.device(d).type == s.type:
        return False
    if s.type == "cuda":
        return True  # to the host
    return torch.device(d).type == "cuda" and not src.is_pinned()


class _Mode(TorchDispatchMode):
    def __init__(self, note):
        super().__init__()
        self._note = note

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SCALAR:
            self._note("item", seen_by_mode=True)
        elif func in _COPIES and _blocking_copy(func, args, kwargs):
            self._note("blocking copy")
        return func(*args, **kwargs)


class HostReads:
    """A context manager that counts host reads of tensor values (see the module docstring).

    Attributes:
        count: reads so far.
        kinds: a :class:`collections.Counter` of ``"item"``, ``"tolist"``, ``"blocking copy"``.
        where: one ``"file:line in function"`` per read: the innermost frame outside torch and
            this module, so a test failure names the line that reads.

    Nesting is allowed (each counts what runs inside it). ``Tensor.item`` and ``Tensor.tolist``
    are wrapped while any counter is open (for the threads that opened one; the wrappers cost
    nothing to other calls, where a profile hook would run on every Python call, hundreds per
    op under the dispatch mode); they and the dispatch mode are removed on exit, also when the
    body raises.

    Example::

        >>> with HostReads() as r:
        ...     torch.ones(2).sum().item()
        >>> r.count, dict(r.kinds)
        (1, {'item': 1})
    """

    def __init__(self) -> None:
        self.count = 0
        self.kinds: Counter = Counter()
        self.where: list[str] = []
        self._mode: _Mode | None = None
        self._thread = 0
        self._in_item = 0  # inside a Tensor.item() the wrapper counted already

    def _note(self, kind: str, seen_by_mode: bool = False) -> None:
        if seen_by_mode and self._in_item:
            return
        self.count += 1
        self.kinds[kind] += 1
        self.where.append(_caller())

    def __enter__(self) -> HostReads:
        self._thread = threading.get_ident()
        _Methods.open(self)
        self._mode = _Mode(self._note)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        _Methods.close(self)
        mode, self._mode = self._mode, None
        mode.__exit__(*exc)

    def reset(self) -> None:
        """Start counting from zero (what was seen so far is forgotten)."""
        self.count = 0
        self.kinds.clear()
        self.where.clear()


class _Methods:
    """``Tensor.item`` / ``Tensor.tolist`` wrapped while counters are open: each call is noted
    by every open counter of the calling thread, then the original runs."""

    _open: list[HostReads] = []
    _lock = threading.Lock()
    _originals: dict[str, object] = {}

    @classmethod
    def open(cls, reads: HostReads) -> None:
        with cls._lock:
            if not cls._open:
                for name in ("item", "tolist"):
                    cls._originals[name] = torch.Tensor.__dict__.get(name)
                    setattr(torch.Tensor, name, cls._wrapper(name))
            cls._open.append(reads)

    @classmethod
    def close(cls, reads: HostReads) -> None:
        with cls._lock:
            cls._open.remove(reads)
            if not cls._open:
                for name, original in cls._originals.items():
                    if original is None:
                        delattr(torch.Tensor, name)  # the method of torch._C.TensorBase again
                    else:
                        setattr(torch.Tensor, name, original)
                cls._originals.clear()

    @classmethod
    def _wrapper(cls, name: str):
        base = getattr(torch._C.TensorBase, name)
        if name == "tolist":

            def tolist(self, *args, **kwargs):
                for r in cls._counting():
                    r._note("tolist")
                return base(self, *args, **kwargs)

            return tolist

        def item(self, *args, **kwargs):
            readers = cls._counting()
            for r in readers:
                r._note("item")
                r._in_item += 1
            try:
                return base(self, *args, **kwargs)
            finally:
                for r in readers:
                    r._in_item = max(0, r._in_item - 1)

        return item

    @classmethod
    def _counting(cls) -> list[HostReads]:
        me = threading.get_ident()
        return [r for r in cls._open if r._thread == me]


def _caller() -> str:
    """The innermost frame of the stack that is neither torch's nor this module's."""
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    for fs in reversed(traceback.extract_stack()[:-3]):
        if fs.filename == _HERE or fs.filename.startswith(torch_dir):
            continue
        return f"{fs.filename}:{fs.lineno} in {fs.name}"
    return "?"
