"""Host cost per call of the multi-tensor Triton launchers vs torch's foreach and fused ops.

What a list op costs the host decides whether a GPU step is launch-bound: the GPU waits while
the host checks the arguments, builds the chunk table and launches. This suite times that host
work alone, on any machine, with the kernel launch stubbed out
(:func:`~mpnb.core.ops.triton._common.counting_launches`). PyTorch's side is the matching
``torch._foreach_mul_`` / ``torch._fused_adamw_`` on meta tensors: its dispatch and per-tensor
work with no kernel run. mpnb's side runs on the very same meta lists (so both read the same
tensor objects; a GPU tensor's host object, like a meta tensor's, sits apart from its data):

* the launcher as the CUDA key calls it (its checks, the chunk table, the argument lists), with
  the table cached on the device (a training loop's steady state) and built afresh on every
  call (what every call paid before the cache);
* the whole call as a CUDA step makes it: the public op (its wrapper and O(1) checks), the
  dispatcher (which hands the lists to the Python launcher) and the launcher, with the launcher
  registered for the Meta key while the suite runs (:func:`_launchers_on_meta`).

Two lists: a small GPT's 76 parameters (~20M elements) and 1,000 tensors of 1,000 elements.

The ratio is torch's host time over mpnb's: at least 1.0 means mpnb costs the host no more than
torch's call. Both sides run on meta tensors on any machine (``--device`` is not read): the
host work of a call does not depend on where the data is. Torch's meta ``_foreach_mul_`` is a
loop over its tensors (on CUDA tensors the same call takes a fused path), ``_fused_adamw_`` one
call for the lists.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from mpnb.lab.bench._harness import READ, Candidate, Case, Options
from mpnb.lab.bench.multi_tensor import gpt_numels

__all__ = ["cases", "WORKLOADS"]

WORKLOADS = {
    "GPT 20M/76": lambda: gpt_numels(),
    "1000x1k": lambda: [1_000] * 1_000,
}
#: mpnb's cached launcher must cost the host no more than torch's call (issue target)
TARGET = 1.0

_ADAM = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _triton():
    try:
        from mpnb.core.ops.triton import _chunks, _common, launcher
    except ImportError as e:  # triton ships Linux wheels only
        raise RuntimeError(
            f"the host-cost suite times mpnb's Triton launchers, and triton cannot be imported "
            f"here ({e}); pip install triton numpy (both are in the dev extra)."
        ) from e
    return launcher, _common.counting_launches, _chunks.clear_cache


#: the ops whose whole call the suite times (their launchers serve the Meta key meanwhile)
_OPS = ("multi_tensor_scale", "fused_adam_")


def _lists(numels: list[int], k: int) -> list[list[torch.Tensor]]:
    return [[torch.empty(n, device="meta") for n in numels] for _ in range(k)]


@contextlib.contextmanager
def _launchers_on_meta() -> Iterator[None]:
    """Inside the block, calls of :data:`_OPS` on meta tensors reach their Triton launchers
    (through the dispatcher, as a CUDA call does) instead of their fakes; leaving it (also by
    an exception) restores the fakes."""
    from mpnb.core.ops._library import ensure_kernels, op_info

    ensure_kernels()  # the C++ library: the lists' one-pass checks, the Autograd kernels
    lib = torch.library.Library("mpnb", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered")
            for name in _OPS:
                lib.impl(name, op_info(name).triton_kernel(), "Meta")
        yield
    finally:
        lib._destroy()


def _ours(name: str, launcher_call, op_call) -> list[Candidate]:
    """The launcher with its table cached and built per call, and the whole call (cached)."""
    _, counting, clear = _triton()

    def cached():
        with counting():
            launcher_call()

    def fresh():
        clear()
        with counting():
            launcher_call()

    def whole():
        with counting():
            op_call()

    return [
        Candidate(f"mpnb {name} launcher, table cached", cached, 0, READ, TARGET),
        Candidate(f"mpnb {name} launcher, table built per call", fresh, 0, READ),
        Candidate(f"mpnb {name} op (wrapper, dispatcher, launcher)", whole, 0, READ, TARGET),
    ]


def _scale(work: str, numels: list[int]) -> Case:
    from mpnb.core.ops import multi_tensor_scale

    launcher = _triton()[0]("multi_tensor_scale")
    src, dst = _lists(numels, 2)
    flag = torch.zeros(1, dtype=torch.int32, device="meta")

    return Case(
        "scale host cost",
        work,
        [
            Candidate("torch._foreach_mul_ (meta)", lambda: torch._foreach_mul_(src, 0.5), 0, READ),
            *_ours(
                "multi_tensor_scale",
                lambda: launcher(noop_flag=flag, src=src, dst=dst, scale=0.5),
                lambda: multi_tensor_scale(flag, src, dst, scale=0.5),
            ),
        ],
    )


def _adam(work: str, numels: list[int]) -> Case:
    from mpnb.core.ops import fused_adam_

    launcher = _triton()[0]("fused_adam_")
    p, g, m, v = _lists(numels, 4)
    steps = [torch.empty((), device="meta") for _ in numels]
    kw = dict(lr=1e-3, adam_w_mode=True, bias_correction=True, **_ADAM)

    def torch_adamw():
        torch._fused_adamw_(p, g, m, v, [], steps, lr=1e-3, amsgrad=False, maximize=False, **_ADAM)

    return Case(
        "adamw host cost",
        work,
        [
            Candidate("torch._fused_adamw_ (meta)", torch_adamw, 0, READ),
            *_ours(
                "fused_adam_",
                lambda: launcher(
                    params=p, grads=g, exp_avgs=m, exp_avg_sqs=v, masters=[], steps=steps, **kw
                ),
                lambda: fused_adam_(p, g, m, v, [], steps, **kw),
            ),
        ],
    )


def cases(opts: Options) -> Iterator[Case]:
    """Per list, the scale and AdamW launchers' host cost beside torch's (one list alive at
    a time; ``--scale`` shrinks the element counts, not the tensor counts; the tensors are
    meta tensors whatever ``--device`` says)."""
    _triton()
    with _launchers_on_meta():
        for work, make in WORKLOADS.items():
            numels = [max(1, round(k * opts.scale)) for k in make()]
            yield _scale(work, numels)
            yield _adam(work, numels)
