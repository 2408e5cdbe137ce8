"""Triton GPU kernels vs PyTorch's fused CUDA ops and the same-run bandwidth (needs a GPU).

Run with ``mpnb bench --device cuda``. Each case times one of mpnb's Triton kernels (called
through its launcher, so ``MPNB_TRITON`` does not matter here) against what PyTorch offers for
the same work on CUDA, round-robin in one process, and against the in-place ``a += s*b``
(kernels that write) or ``x.sum()`` (read-only kernels) bandwidth measured in the same rounds:

* lists (a small GPT's 20M grads in 76 tensors, and 200 tensors of 1,000): the unscale of bf16
  grads into fp32 (``_foreach_copy_`` + ``_amp_foreach_non_finite_check_and_unscale_``), the
  L2 norm (``_foreach_norm``), and the O2 optimizer steps on bf16 params with fp32 masters:
  AdamW (``torch._fused_adamw_``), SGD with momentum (``torch._fused_sgd_``), each with the
  unscale and the cast back that mpnb's PyTorch path adds, and LAMB (PyTorch has no fused
  LAMB: ``torch._foreach_*`` ops);
* layers in bf16: layer norm and RMS norm forward and backward (``F.layer_norm``,
  ``F.rms_norm``, ``aten.native_layer_norm_backward``, ``aten._fused_rms_norm_backward``), the
  scaled masked and causal softmax (``softmax(masked_fill(x * scale))``) and its backward
  (``aten._softmax_backward_data``), and RoPE (PyTorch ops, as mpnb's reference).

``bytes`` is the least traffic of the operation (each input read once, each output written
once), the same for both sides. Every kernel is compiled before it is timed. The ratios are
what decides whether a kernel may leave opt-in (``mpnb doctor`` reports "unmeasured" until
then).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from mpnb.lab.bench._cuda_layers import case, norm_cases, randn, rope_case, softmax_cases
from mpnb.lab.bench._harness import READ, RMW, Case, Options
from mpnb.lab.bench.multi_tensor import gpt_numels

__all__ = ["cases", "unavailable"]

_GPT, _SMALL = "(a) GPT 20M/76", "(c) 200x1k"
_LR, _B1, _B2, _EPS, _WD = 1e-4, 0.9, 0.999, 1e-8, 0.01


def unavailable(opts: Options) -> str | None:
    """Why this suite cannot run with ``opts`` here (None when it can)."""
    try:
        dev = torch.device(opts.device)
    except RuntimeError as e:
        return f"--device {opts.device!r} is not a device torch knows ({e})."
    if dev.type != "cuda":
        return (
            "the cuda suite measures GPU kernels and needs a CUDA GPU: run "
            "`mpnb bench --device cuda` on a machine with one."
        )
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        return (
            f"--device {opts.device}: no CUDA GPU is visible to torch {torch.__version__} "
            f"({build}); run on a machine with an NVIDIA GPU and a CUDA build of torch."
        )
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton cannot be imported ({e}): pip install triton (Linux)."
    return None


# ---- lists ---------------------------------------------------------------------------------


def _list_cases(work: str, numels: list[int], dev: str, quick: bool) -> Iterator[Case]:
    from mpnb.core.ops.triton import launcher

    n = sum(numels)
    grads = randn(numels, torch.bfloat16, dev, 0, 1e-3)
    master_grads = [torch.empty(k, device=dev) for k in numels]
    found = torch.zeros(1, device=dev)
    inv = torch.full((1,), 1 / 65536, device=dev)

    def torch_unscale():
        torch._foreach_copy_(master_grads, grads)
        torch._amp_foreach_non_finite_check_and_unscale_(master_grads, found, inv)

    scale = launcher("multi_tensor_scale")
    yield case(
        "unscale bf16->fp32",
        work,
        ("torch foreach_copy_ + amp unscale_", torch_unscale),
        ("triton multi_tensor_scale", lambda: scale(found, grads, master_grads, 1.0, inv)),
        6 * n,
        RMW,
        n,
        dev,
    )
    norm = launcher("multi_tensor_l2norm")
    yield case(
        "l2norm bf16",
        work,
        (
            "torch _foreach_norm + norm",
            lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))),
        ),
        ("triton multi_tensor_l2norm", lambda: norm(found, grads)),
        2 * n,
        READ,
        n,
        dev,
    )
    yield from _optimizer_cases(work, numels, grads, inv, found, dev, quick)


def _o2_state(numels, dev, seed):
    masters = randn(numels, torch.float32, dev, seed)
    params = [w.to(torch.bfloat16) for w in masters]
    moments = [[torch.zeros_like(w) for w in masters] for _ in range(2)]
    steps = [torch.zeros((), device=dev) for _ in numels]
    return params, masters, moments, steps


def _optimizer_cases(work, numels, grads, inv, found, dev, quick) -> Iterator[Case]:
    from mpnb.core.ops.triton import launcher

    n = sum(numels)
    p, w, (m, v), steps = _o2_state(numels, dev, 1)
    tp, tw, (tm, tv), tsteps = _o2_state(numels, dev, 1)

    def unscaled():  # mpnb's PyTorch path: fp32 copies of the grads, unscaled
        g32 = [g.float() for g in grads]
        torch._foreach_mul_(g32, inv.reshape(()))
        return g32

    def torch_adamw():
        torch._fused_adamw_(
            tw,
            unscaled(),
            tm,
            tv,
            [],
            tsteps,
            lr=_LR,
            beta1=_B1,
            beta2=_B2,
            weight_decay=_WD,
            eps=_EPS,
            amsgrad=False,
            maximize=False,
            found_inf=found,
        )
        torch._foreach_copy_(tp, tw)

    adam = launcher("fused_adam_")
    yield case(
        "AdamW O2 bf16",
        work,
        ("torch _fused_adamw_ + unscale + cast", torch_adamw),
        (
            "triton fused_adam_",
            lambda: adam(
                p, grads, m, v, w, steps, _LR, _B1, _B2, _EPS, _WD, True, True, inv, found
            ),
        ),
        28 * n,
        RMW,
        n,
        dev,
    )

    def torch_sgd():
        torch._fused_sgd_(
            tw,
            unscaled(),
            tm,
            weight_decay=_WD,
            momentum=0.9,
            lr=_LR,
            dampening=0.0,
            nesterov=True,
            maximize=False,
            is_first_step=False,
            found_inf=found,
        )
        torch._foreach_copy_(tp, tw)

    sgd = launcher("fused_sgd_")
    first = [False] * len(p)
    yield case(
        "SGD nesterov O2 bf16",
        work,
        ("torch _fused_sgd_ + unscale + cast", torch_sgd),
        (
            "triton fused_sgd_",
            lambda: sgd(p, grads, m, w, first, _LR, 0.9, 0.0, _WD, True, False, inv, found),
        ),
        20 * n,
        RMW,
        n,
        dev,
    )
    if quick:
        return
    gnorm = torch.ones(1, device=dev)
    lamb = launcher("fused_lamb_")
    yield case(
        "LAMB O2 bf16",
        work,
        (
            "torch _foreach_* LAMB + unscale + cast",
            lambda: _foreach_lamb(tp, tw, tm, tv, unscaled()),
        ),
        (
            "triton fused_lamb_",
            lambda: lamb(
                p,
                grads,
                m,
                v,
                w,
                steps,
                gnorm,
                _LR,
                _B1,
                _B2,
                _EPS,
                _WD,
                True,
                False,
                True,
                1.0,
                False,
                inv,
                found,
            ),
        ),
        28 * n,
        RMW,
        n,
        dev,
    )


def _foreach_lamb(params, w, m, v, g) -> None:
    """LAMB's update in PyTorch's foreach ops (no bias correction, no clipping: a little less
    work than the kernel does), then the cast back to the half params."""
    torch._foreach_lerp_(m, g, 1 - _B1)
    torch._foreach_mul_(v, _B2)
    torch._foreach_addcmul_(v, g, g, 1 - _B2)
    u = torch._foreach_div(m, torch._foreach_add(torch._foreach_sqrt(v), _EPS))
    torch._foreach_add_(u, w, alpha=_WD)
    ratio = torch.stack(torch._foreach_norm(w)) / torch.stack(torch._foreach_norm(u))
    torch._foreach_mul_(u, list(torch.unbind(ratio * -_LR)))
    torch._foreach_add_(w, u)
    torch._foreach_copy_(params, w)


def cases(opts: Options) -> Iterator[Case]:
    """Yield the cases one workload at a time (one workload's tensors alive at once)."""
    why = unavailable(opts)
    if why:
        raise RuntimeError(why)
    dev, q = opts.device, opts.quick

    def size(k: int) -> int:
        return max(1, round(k * opts.scale))

    lists: dict[str, Callable[[], list[int]]] = {_GPT: gpt_numels, _SMALL: lambda: [1_000] * 200}
    for work, make in lists.items():
        yield from _list_cases(work, [size(k) for k in make()], dev, q)
    yield from norm_cases(size(8192), 4096, dev, q)
    yield from softmax_cases(4, 16, max(8, round(1024 * opts.scale**0.5)), dev, q)
    yield rope_case(size(4096), 4, 32, 128, dev)
