"""Host cost per call of the multi-tensor Triton launchers vs torch's foreach and fused ops.

What a list op costs the host decides whether a GPU step is launch-bound: the GPU waits while
the host checks the arguments, builds the chunk table and launches. The list ops and the torch
call each is timed against:

* ``multi_tensor_scale`` (amp's unscale): ``torch._foreach_mul_``;
* ``multi_tensor_l2norm`` with per-tensor norms (LAMB, clipping): ``torch._foreach_norm``;
* ``fused_adam_`` (AdamW): ``torch._fused_adamw_``;
* ``fused_sgd_`` without momentum: ``torch._fused_sgd_`` (what ``SGD(fused=True)`` calls).

Two lists: a small GPT's 76 parameters (~20M elements) and 1,000 tensors of 1,000 elements.
The ratio is torch's host time over mpnb's: at least 1.0 means mpnb costs the host no more than
torch's call. Two ways, by ``--device``:

**On CUDA** (``--device cuda``, the GPU check) both sides run for real on CUDA tensors: torch's
call takes its fused CUDA path (one C++ call, its own launches), mpnb's its Triton launcher
with its real launches (Triton's launch included), registered for the CUDA key while the suite
runs whether or not ``measured.json`` puts it on by default (:func:`_launchers_on`). Each
tensor is cut to at most :data:`GPU_NUMEL` elements, the tensor counts kept: a call's host work
does not depend on the element count, and the GPU's work must stay below the host's for the
timed wall time to be the host's. This is the figure the target is judged by.

**Anywhere else** mpnb's side runs on meta tensors with the kernel launch stubbed out
(:func:`~mpnb.core.ops.triton._common.counting_launches`), so it lacks Triton's own launch
cost; torch's side is its call on CPU tensors of one element each, the same count: its
dispatch and per-tensor work with next to no arithmetic (torch's meta ``_foreach_norm`` runs
a Python decomposition, ten times its C++ path, and meta has no ``_fused_sgd_``). Torch's CPU
``_foreach_*`` ops loop over their tensors in C++, where its CUDA path is one fused call, so a
CPU ratio for scale and l2norm flatters mpnb; its fused AdamW and SGD are one C++ call on the
CPU as on CUDA. mpnb's three rows, and a fourth beside them:

* the launcher as the CUDA key calls it (its checks, the chunk table, the argument lists), with
  the table cached on the device (a training loop's steady state) and built afresh on every
  call (what every call paid before the cache);
* the whole call as a CUDA step makes it: the public op (its wrapper and O(1) checks), the
  dispatcher (which hands the lists to the Python launcher) and the launcher, with the launcher
  registered for the lists' key while the suite runs (:func:`_launchers_on`);
* the dispatcher's floor: the same lists through a ``torch.library`` op whose Python kernel
  does nothing (:func:`_floor`). Every tensor crosses torch's boxed calling convention twice
  (Python to the dispatcher's stack, the stack to the Python kernel), about 50 ns a tensor
  each way (torch 2.13 on an AVX-512 Xeon): the least a Python launcher behind the
  dispatcher can cost, shown so the whole call's row reads as floor + launcher.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from mpnb.lab.bench._harness import READ, Candidate, Case, Options
from mpnb.lab.bench.multi_tensor import gpt_numels

__all__ = ["cases", "WORKLOADS", "GPU_NUMEL"]

WORKLOADS = {
    "GPT 20M/76": lambda: gpt_numels(),
    "1000x1k": lambda: [1_000] * 1_000,
}
#: mpnb's cached launcher must cost the host no more than torch's call (issue target)
TARGET = 1.0
#: the most elements of a tensor on CUDA: a GPT list of 76 such tensors is one or two chunk
#: programs per tensor, microseconds of GPU work per call against a host cost of tens
GPU_NUMEL = 4096

_ADAM = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
_SGD = dict(weight_decay=0.0, momentum=0.0, dampening=0.0, nesterov=False, maximize=False)


def _triton():
    try:
        from mpnb.core.ops.triton import _chunks, _common, launcher
    except ImportError as e:  # triton ships Linux wheels only
        raise RuntimeError(
            f"the host-cost suite times mpnb's Triton launchers, and triton cannot be imported "
            f"here ({e}); pip install triton numpy (both are in the dev extra)."
        ) from e
    return launcher, _common.counting_launches, _chunks.clear_cache


#: the ops whose whole call the suite times (their launchers serve the lists' key meanwhile)
_OPS = ("multi_tensor_scale", "multi_tensor_l2norm", "fused_adam_", "fused_sgd_")


@dataclass(frozen=True)
class Where:
    """Where one run's lists live. ``ours``: mpnb's lists' device (``"meta"``, or the real
    device whose launches run); ``torch``: torch's; ``one``: torch's tensors hold one element
    each (the CPU base); ``real``: mpnb's kernels launch (no stub)."""

    ours: str
    torch: str
    one: bool
    real: bool

    @classmethod
    def of(cls, device: str) -> Where:
        """CUDA: both sides real on ``device``; else meta and stubbed launches for mpnb, CPU
        tensors of one element for torch."""
        if str(device).startswith("cuda"):
            return cls(str(device), str(device), False, True)
        return cls("meta", "cpu", True, False)

    def lists(self, numels: list[int], k: int, mine: bool = True) -> list[list[torch.Tensor]]:
        """``k`` zero-filled lists of ``numels`` on mpnb's device (``mine``) or torch's."""
        dev = self.ours if mine else self.torch
        sizes = [1] * len(numels) if not mine and self.one else numels
        return [[torch.zeros(n, device=dev) for n in sizes] for _ in range(k)]

    def scalars(self, n: int, mine: bool = True) -> list[torch.Tensor]:
        """``n`` one-element fp32 step counts on mpnb's device or torch's."""
        return [torch.zeros((), device=self.ours if mine else self.torch) for _ in range(n)]

    def flag(self) -> torch.Tensor:
        """mpnb's int32 overflow flag."""
        return torch.zeros(1, dtype=torch.int32, device=self.ours)


@contextlib.contextmanager
def _launchers_on(key: str) -> Iterator[None]:
    """Inside the block, calls of :data:`_OPS` on ``key``'s tensors (``"Meta"``, ``"CUDA"``)
    reach their Triton launchers through the dispatcher, as a CUDA call does where they are on
    by default; leaving it (also by an exception) restores the registered kernels (the fakes
    on meta, the kernels ``measured.json`` chose on CUDA)."""
    from mpnb.core.ops._library import ensure_kernels, op_info

    ensure_kernels()  # the C++ library: the lists' one-pass checks, the Autograd kernels
    lib = torch.library.Library("mpnb", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered")
            for name in _OPS:
                lib.impl(name, op_info(name).triton_kernel(), key)
        yield
    finally:
        lib._destroy()


#: the no-op op of :func:`_floor`: its library (kept alive) once defined
_FLOOR: list = []
_FLOOR_LISTS = 6  #: tensor lists the no-op takes (AdamW's five and its steps)


def _floor(*lists: list[torch.Tensor]) -> None:
    """``mpnb_bench::floor``, a ``torch.library`` op of :data:`_FLOOR_LISTS` tensor lists whose
    Python kernel (for the Meta, CUDA and CPU keys) does nothing, called on ``lists`` (the rest
    empty): the dispatcher's cost of taking lists to a Python kernel, and nothing else."""
    if not _FLOOR:
        lib = torch.library.Library("mpnb_bench", "DEF")
        args = ", ".join(f"Tensor(a{i}!)[] l{i}" for i in range(_FLOOR_LISTS))
        lib.define(f"floor({args}) -> ()")
        for key in ("Meta", "CUDA", "CPU"):
            lib.impl("floor", _nothing, key)
        _FLOOR.append(lib)
    torch.ops.mpnb_bench.floor.default(*lists, *([[]] * (_FLOOR_LISTS - len(lists))))


def _nothing(*lists) -> None:
    return None


def _floor_row(lists: list[list[torch.Tensor]]) -> Candidate:
    """The dispatcher's floor (:func:`_floor`) on mpnb's ``lists`` of the case."""
    n = sum(map(len, lists))
    name = f"dispatcher floor: a no-op Python kernel on the same {n} tensors"
    return Candidate(name, lambda: _floor(*lists), 0, READ)


def _ours(name: str, where: Where, launcher_call, op_call) -> list[Candidate]:
    """The launcher with its table cached and built per call, and the whole call (cached);
    launches stubbed unless ``where.real``."""
    _, counting, clear = _triton()
    stub = contextlib.nullcontext if where.real else counting

    def cached():
        with stub():
            launcher_call()

    def fresh():
        clear()
        with stub():
            launcher_call()

    def whole():
        with stub():
            op_call()

    return [
        Candidate(f"mpnb {name} launcher, table cached", cached, 0, READ, TARGET),
        Candidate(f"mpnb {name} launcher, table built per call", fresh, 0, READ),
        Candidate(f"mpnb {name} op (wrapper, dispatcher, launcher)", whole, 0, READ, TARGET),
    ]


def _base(label: str, where: Where, fn: Callable) -> Candidate:
    """Torch's call, named with where it runs (``"(cpu, 1 element each)"``, ``"(cuda)"``)."""
    how = f"{where.torch}, 1 element each" if where.one else where.torch
    return Candidate(f"{label} ({how})", fn, 0, READ)


def _scale(work: str, numels: list[int], where: Where) -> Case:
    from mpnb.core.ops import multi_tensor_scale

    launcher = _triton()[0]("multi_tensor_scale")
    src, dst = where.lists(numels, 2)
    (theirs,) = where.lists(numels, 1, mine=False)
    flag = where.flag()

    return Case(
        "scale host cost",
        work,
        [
            _base("torch._foreach_mul_", where, lambda: torch._foreach_mul_(theirs, 0.5)),
            *_ours(
                "multi_tensor_scale",
                where,
                lambda: launcher(noop_flag=flag, src=src, dst=dst, scale=0.5),
                lambda: multi_tensor_scale(flag, src, dst, scale=0.5),
            ),
            _floor_row([src, dst]),
        ],
    )


def _l2norm(work: str, numels: list[int], where: Where) -> Case:
    from mpnb.core.ops import multi_tensor_l2norm

    launcher = _triton()[0]("multi_tensor_l2norm")
    (tensors,) = where.lists(numels, 1)
    (theirs,) = where.lists(numels, 1, mine=False)
    flag = where.flag()

    return Case(
        "l2norm host cost",
        work,
        [
            _base("torch._foreach_norm", where, lambda: torch._foreach_norm(theirs)),
            *_ours(
                "multi_tensor_l2norm",
                where,
                lambda: launcher(noop_flag=flag, tensors=tensors, per_tensor=True),
                lambda: multi_tensor_l2norm(flag, tensors, per_tensor=True),
            ),
            _floor_row([tensors]),
        ],
    )


def _adam(work: str, numels: list[int], where: Where) -> Case:
    from mpnb.core.ops import fused_adam_

    launcher = _triton()[0]("fused_adam_")
    p, g, m, v = where.lists(numels, 4)
    steps = where.scalars(len(numels))
    tp, tg, tm, tv = where.lists(numels, 4, mine=False)
    t_steps = where.scalars(len(numels), mine=False)
    kw = dict(lr=1e-3, adam_w_mode=True, bias_correction=True, **_ADAM)

    def torch_adamw():
        torch._fused_adamw_(
            tp, tg, tm, tv, [], t_steps, lr=1e-3, amsgrad=False, maximize=False, **_ADAM
        )

    return Case(
        "adamw host cost",
        work,
        [
            _base("torch._fused_adamw_", where, torch_adamw),
            *_ours(
                "fused_adam_",
                where,
                lambda: launcher(
                    params=p, grads=g, exp_avgs=m, exp_avg_sqs=v, masters=[], steps=steps, **kw
                ),
                lambda: fused_adam_(p, g, m, v, [], steps, **kw),
            ),
            _floor_row([p, g, m, v, steps]),
        ],
    )


def _sgd(work: str, numels: list[int], where: Where) -> Case:
    from mpnb.core.ops import fused_sgd_

    launcher = _triton()[0]("fused_sgd_")
    p, g = where.lists(numels, 2)
    tp, tg = where.lists(numels, 2, mine=False)

    def torch_sgd():
        torch._fused_sgd_(tp, tg, [], lr=0.1, is_first_step=False, **_SGD)

    return Case(
        "sgd host cost",
        work,
        [
            _base("torch._fused_sgd_", where, torch_sgd),
            *_ours(
                "fused_sgd_",
                where,
                lambda: launcher(
                    params=p, grads=g, momentum_buffers=[], masters=[], first_run=[], lr=0.1
                ),
                lambda: fused_sgd_(p, g, [], [], [], lr=0.1),
            ),
            _floor_row([p, g]),
        ],
    )


def _numels(make: Callable[[], list[int]], scale: float, where: Where) -> list[int]:
    """The workload's element counts, scaled (``--scale``), cut to :data:`GPU_NUMEL` where the
    kernels run for real."""
    numels = [max(1, round(k * scale)) for k in make()]
    return [min(n, GPU_NUMEL) for n in numels] if where.real else numels


def cases_on(
    where: Where, scale: float = 1.0, workloads: tuple[str, ...] = tuple(WORKLOADS)
) -> Iterator[Case]:
    """The suite's cases for ``where`` on the lists ``workloads`` (names of
    :data:`WORKLOADS`; one list alive at a time), inside the block that routes the ops to
    their launchers on mpnb's device."""
    _triton()
    key = "Meta" if where.ours == "meta" else torch.device(where.ours).type.upper()
    with _launchers_on(key):
        for work in workloads:
            make = WORKLOADS[work]
            numels = _numels(make, scale, where)
            for case in (_scale, _l2norm, _adam, _sgd):
                yield case(work, numels, where)


def cases(opts: Options) -> Iterator[Case]:
    """Per list, the scale, l2norm, AdamW and SGD launchers' host cost beside torch's: on CUDA
    both for real on CUDA tensors, elsewhere mpnb's on meta tensors with stubbed launches
    (``--scale`` shrinks the element counts, not the tensor counts)."""
    yield from cases_on(Where.of(opts.device), opts.scale)
