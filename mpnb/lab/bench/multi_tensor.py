"""Multi-tensor kernels (scale, axpby, l2norm, check_finite) vs torch._foreach_* and torch._amp_*.

Three workloads: (a) the ~20M gradients of a small GPT in 76 tensors, (b) 2,000 tensors of
10,000 elements, (c) 200 tensors of 1,000 elements. Model grads are bf16 where the case is
about a loss-scaled half backward (unscale, overflow check); master grads are fp32.

Every candidate is repeatable: outputs are preallocated and reused by both sides, and the
PyTorch baselines that mutate their input either re-copy it first (unscale: the copy is part
of the work being compared) or scale by 1.0 (the overflow check). ``bytes`` is the least
traffic the operation needs (one read of each input, one write of each output), the same for
both sides, so GB/s is an effective bandwidth and directly comparable.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mpnb.core.ops import (
    multi_tensor_axpby,
    multi_tensor_check_finite,
    multi_tensor_l2norm,
    multi_tensor_scale,
)
from mpnb.lab.bench._harness import READ, RMW, Candidate, Case, Options

__all__ = ["cases", "gpt_numels", "WORKLOADS"]

# name -> (sizes factory, targets): targets per case key, as (speed-up, bandwidth fraction).
_A, _B, _C = "(a) GPT 20M/76", "(b) 2000x10k", "(c) 200x1k"


def gpt_numels(vocab: int = 23_296, d: int = 384, layers: int = 6, ctx: int = 1024) -> list[int]:
    """Element counts of a small GPT's parameters (76 tensors, ~20M elements by default)."""
    sizes = [vocab * d, ctx * d]  # token and position embeddings
    for _ in range(layers):
        sizes += [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return sizes + [d, d]  # final layer norm


WORKLOADS = {
    _A: lambda: gpt_numels(),
    _B: lambda: [10_000] * 2_000,
    _C: lambda: [1_000] * 200,
}

# (case, workload) -> (speed-up target, bandwidth target); from the issue.
_TARGETS = {
    ("unscale", _A): (1.7, None),
    ("unscale", _C): (4.0, None),
    ("check", _A): (2.5, 0.80),
    ("l2norm", _A): (1.3, 0.80),
    ("l2norm", _B): (1.3, None),
    ("scale", _A): (None, 0.85),
    ("axpby", _A): (None, 0.85),
}


def _tensors(numels: list[int], dtype: torch.dtype, device: str, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(device=device, dtype=dtype) for n in numels]


def _ours(name: str, fn, nbytes: int, access: str, key: str, workload: str) -> Candidate:
    target, bw_target = _TARGETS.get((key, workload), (None, None))
    return Candidate(name, fn, nbytes, access, target, bw_target)


def _scale(work: str, numels: list[int], dev: str, src_dtype: torch.dtype) -> Case:
    """Model grads (``src_dtype``) into fp32 master grads times 1/65536, with the flag."""
    n, size = sum(numels), torch.empty((), dtype=src_dtype).element_size()
    grads = _tensors(numels, src_dtype, dev, 0)
    master = [torch.empty(k, device=dev) for k in numels]
    found_inf = torch.zeros(1, device=dev)
    inv = torch.full((1,), 1 / 65536, device=dev)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)

    def torch_unscale():  # the re-copy is part of the work: master = grads * inv, flagged
        torch._foreach_copy_(master, grads)
        torch._amp_foreach_non_finite_check_and_unscale_(master, found_inf, inv)

    def ours():
        multi_tensor_scale(flag, grads, master, scale=1 / 65536)

    half = src_dtype != torch.float32
    name, key = ("unscale bf16->fp32", "unscale") if half else ("scale fp32->fp32", "scale")
    nbytes = (size + 4) * n
    return Case(
        name,
        work,
        [
            Candidate("torch foreach_copy_ + amp unscale_", torch_unscale, nbytes, RMW),
            _ours("mpnb multi_tensor_scale", ours, nbytes, RMW, key, work),
        ],
        bandwidth_numel=n,
        device=dev,
    )


def _axpby(work: str, numels: list[int], dev: str) -> Case:
    n = sum(numels)
    x, y = _tensors(numels, torch.float32, dev, 2), _tensors(numels, torch.float32, dev, 3)
    out = [torch.empty_like(t) for t in x]
    found_inf = torch.zeros(1, device=dev)
    one = torch.ones(1, device=dev)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)

    def torch_axpby():  # out = 2x + 0.5y, then the overflow check Apex's axpby includes
        torch._foreach_copy_(out, x)
        torch._foreach_mul_(out, 2.0)
        torch._foreach_add_(out, y, alpha=0.5)
        torch._amp_foreach_non_finite_check_and_unscale_(out, found_inf, one)

    return Case(
        "axpby fp32",
        work,
        [
            Candidate("torch foreach copy_/mul_/add_ + check", torch_axpby, 12 * n, RMW),
            _ours(
                "mpnb multi_tensor_axpby",
                lambda: multi_tensor_axpby(flag, x, y, out, a=2.0, b=0.5, arg_to_check=-1),
                12 * n,
                RMW,
                "axpby",
                work,
            ),
        ],
        bandwidth_numel=n,
        device=dev,
    )


def _check(work: str, numels: list[int], dev: str) -> Case:
    n = sum(numels)
    grads = _tensors(numels, torch.bfloat16, dev, 4)
    found_inf = torch.zeros(1, device=dev)
    one = torch.ones(1, device=dev)  # 1.0: repeated calls leave the grads unchanged
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    return Case(
        "inf/NaN check bf16",
        work,
        [
            Candidate(
                "torch amp unscale_ (inv_scale 1.0)",
                lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one),
                2 * n,
                READ,
            ),
            _ours(
                "mpnb multi_tensor_check_finite",
                lambda: multi_tensor_check_finite(flag, grads),
                2 * n,
                READ,
                "check",
                work,
            ),
        ],
        bandwidth_numel=n,
        device=dev,
    )


def _l2norm(work: str, numels: list[int], dev: str, dtype: torch.dtype = torch.float32) -> Case:
    n = sum(numels)
    ts = _tensors(numels, dtype, dev, 5)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    size = ts[0].element_size()

    def torch_norm():
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts)))

    key = "l2norm" if dtype == torch.float32 else "l2norm-" + str(dtype)
    return Case(
        f"l2norm {str(dtype).removeprefix('torch.')}",
        work,
        [
            Candidate("torch _foreach_norm + norm", torch_norm, size * n, READ),
            _ours(
                "mpnb multi_tensor_l2norm",
                lambda: multi_tensor_l2norm(flag, ts),
                size * n,
                READ,
                key,
                work,
            ),
        ],
        bandwidth_numel=n,
        device=dev,
    )


def cases(opts: Options) -> Iterator[Case]:
    """Yield the cases workload by workload (one workload's tensors alive at a time)."""
    dev = opts.device
    for work, make in WORKLOADS.items():
        numels = [max(1, round(k * opts.scale)) for k in make()]
        yield _scale(work, numels, dev, torch.bfloat16)
        yield _check(work, numels, dev)
        yield _l2norm(work, numels, dev)
        yield _scale(work, numels, dev, torch.float32)
        yield _axpby(work, numels, dev)
        if work == _A and not opts.quick:
            yield _l2norm(work, numels, dev, torch.bfloat16)
