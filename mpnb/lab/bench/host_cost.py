"""Host cost per call of the multi-tensor Triton launchers vs torch's foreach and fused ops.

What a list op costs the host decides whether a GPU step is launch-bound: the GPU waits while
the host checks the arguments, builds the chunk table and launches. This suite times that host
work alone, on any machine: mpnb's launchers run under
:func:`~mpnb.core.ops.triton._common.counting_launches` (everything but the kernel launch: the
op's checks, the chunk table, the argument lists), once with the chunk table cached on the
device (a training loop's steady state) and once built afresh on every call (what every call
paid before the cache). PyTorch's side is the matching ``torch._foreach_mul_`` /
``torch._fused_adamw_`` on meta tensors of the same shapes: its dispatch and per-tensor work
with no kernel run either. Two lists: a small GPT's 76 parameters (~20M elements) and 1,000
tensors of 1,000 elements.

The ratio is torch's host time over mpnb's: at least 1.0 means mpnb's launcher costs the host
no more than torch's call. On CPU torch's foreach is a loop over its tensors (a GPU build takes
a faster path), so the GPU check reruns this suite with ``--device cuda``.
"""

from __future__ import annotations

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


def _lists(numels: list[int], device: str, k: int) -> list[list[torch.Tensor]]:
    return [[torch.empty(n, device=device) for n in numels] for _ in range(k)]


def _ours(name: str, call, cached: bool) -> Candidate:
    _, counting, clear = _triton()

    def run():
        if not cached:
            clear()
        with counting():
            call()

    label = f"mpnb {name}, table {'cached' if cached else 'built per call'}"
    return Candidate(label, run, 0, READ, TARGET if cached else None)


def _scale(work: str, numels: list[int], device: str) -> Case:
    launcher = _triton()[0]
    src, dst = _lists(numels, device, 2)
    meta = [torch.empty(n, device="meta") for n in numels]
    flag = torch.zeros(1, dtype=torch.int32, device=device)

    def call():
        launcher("multi_tensor_scale")(noop_flag=flag, src=src, dst=dst, scale=0.5)

    return Case(
        "scale host cost",
        work,
        [
            Candidate(
                "torch._foreach_mul_ (meta)", lambda: torch._foreach_mul_(meta, 0.5), 0, READ
            ),
            _ours("multi_tensor_scale", call, cached=True),
            _ours("multi_tensor_scale", call, cached=False),
        ],
    )


def _adam(work: str, numels: list[int], device: str) -> Case:
    launcher = _triton()[0]
    p, g, m, v = _lists(numels, device, 4)
    steps = [torch.zeros((), device=device) for _ in numels]
    mp, mg, mm, mv = ([torch.empty(n, device="meta") for n in numels] for _ in range(4))
    msteps = [torch.empty((), device="meta") for _ in numels]

    def torch_adamw():
        torch._fused_adamw_(
            mp, mg, mm, mv, [], msteps, lr=1e-3, amsgrad=False, maximize=False, **_ADAM
        )

    def call():
        launcher("fused_adam_")(
            params=p,
            grads=g,
            exp_avgs=m,
            exp_avg_sqs=v,
            masters=[],
            steps=steps,
            lr=1e-3,
            adam_w_mode=True,
            bias_correction=True,
            **_ADAM,
        )

    return Case(
        "adamw host cost",
        work,
        [
            Candidate("torch._fused_adamw_ (meta)", torch_adamw, 0, READ),
            _ours("fused_adam_", call, cached=True),
            _ours("fused_adam_", call, cached=False),
        ],
    )


def cases(opts: Options) -> Iterator[Case]:
    """Per list, the scale and AdamW launchers' host cost beside torch's (one list alive at
    a time; ``--scale`` shrinks the element counts, not the tensor counts)."""
    _triton()
    for work, make in WORKLOADS.items():
        numels = [max(1, round(k * opts.scale)) for k in make()]
        yield _scale(work, numels, opts.device)
        yield _adam(work, numels, opts.device)
