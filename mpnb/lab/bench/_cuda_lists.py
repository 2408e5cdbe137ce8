"""The ``cuda`` bench suite's tensor-list cases: the unscale, the L2 norm, the optimizer steps.

See :mod:`mpnb.lab.bench.cuda` for the method. Every case holds the same bf16 grads (seeded,
``randn * 1e-3``: finite, so no step is skipped) and its own optimizer state per side, so both
sides do the same work on every call.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mpnb.core.dtype_names import half_dtype_name
from mpnb.lab.bench._cuda_layers import case, randn
from mpnb.lab.bench._harness import COPY, READ, Case

__all__ = ["list_cases", "O2_STEP_OPS"]

_LR, _B1, _B2, _EPS, _WD = 1e-4, 0.9, 0.999, 1e-8, 0.01
_SR = ("stochastic", 1, 1)  # rounding, seed, rng_step of the pure-bf16 ops
#: The ``mpnb::`` ops an amp O2 step with ``FusedAdam`` dispatches over the param lists, in
#: order (``optimizer.step()`` under a handed-over loss scale): the read-only inf/NaN check of
#: the half grads, then the one-pass AdamW. The "O2 step" case runs exactly these; a test
#: holds the real step to this list.
O2_STEP_OPS = ("multi_tensor_check_finite", "fused_adam_")


def list_cases(work: str, numels: list[int], dev: str, fp16_step: bool = True) -> Iterator[Case]:
    """Every list kernel on one list of ``numels``: unscale, L2 norm, the inf/NaN check, the O2
    steps (AdamW, SGD, LAMB with fp32 masters), the pure-bf16 steps (stochastic rounding) and
    the whole O2 step of mpnb's amp against torch's (bf16 grads; the check and the whole step
    in fp16 too with ``fp16_step``)."""
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
        COPY,
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
    half = [g.to(torch.float16) for g in grads] if fp16_step else None
    yield from _check_cases(work, grads, half, found, dev)
    yield from _o2_cases(work, numels, grads, inv, found, dev)
    yield from _pure_bf16_cases(work, numels, grads, inv, found, dev)
    yield _o2_step_case(work, numels, grads, inv, dev)
    if half is not None:
        yield _o2_step_case(work, numels, half, inv, dev)


def _check_cases(work, grads, half, found, dev) -> Iterator[Case]:
    """The read-only inf/NaN check of the half grads (an O2 step's first op) against what its
    CUDA calls run without the kernel: for bf16 mpnb's reference in PyTorch ops (PyTorch's
    fused check refuses bf16), for fp16 PyTorch's ``_amp_foreach_non_finite_check_and_unscale_``
    by exactly 1.0 (it writes the grads back, unchanged). ``half``: the fp16 grads, or None."""
    from mpnb.core.ops.check_finite import reference_multi_tensor_check_finite
    from mpnb.core.ops.triton import launcher

    n, check = sum(g.numel() for g in grads), launcher("multi_tensor_check_finite")
    yield case(
        "check_finite bf16",
        work,
        (
            "torch ops (mpnb reference: isfinite().all() per tensor)",
            lambda: reference_multi_tensor_check_finite(found, grads),
        ),
        ("triton multi_tensor_check_finite", lambda: check(found, grads)),
        2 * n,
        READ,
        n,
        dev,
    )
    if half is None:
        return
    one = torch.ones(1, device=dev)
    yield case(
        "check_finite fp16",
        work,
        (
            "torch amp unscale_ by 1.0 (reads and writes)",
            lambda: torch._amp_foreach_non_finite_check_and_unscale_(half, found, one),
        ),
        ("triton multi_tensor_check_finite", lambda: check(found, half)),
        2 * n,
        READ,
        n,
        dev,
    )


def _o2_state(numels, dev, seed, half=torch.bfloat16):
    masters = randn(numels, torch.float32, dev, seed)
    params = [w.to(half) for w in masters]
    moments = [[torch.zeros_like(w) for w in masters] for _ in range(2)]
    steps = [torch.zeros((), device=dev) for _ in numels]
    return params, masters, moments, steps


def _adamw(w, g, m, v, steps, found) -> None:
    torch._fused_adamw_(
        w,
        g,
        m,
        v,
        [],
        steps,
        lr=_LR,
        beta1=_B1,
        beta2=_B2,
        weight_decay=_WD,
        eps=_EPS,
        amsgrad=False,
        maximize=False,
        found_inf=found,
    )


def _o2_cases(work, numels, grads, inv, found, dev) -> Iterator[Case]:
    """The optimizer ops with fp32 masters against the op's PyTorch path on CUDA (PyTorch's
    fused op on fp32 copies of the unscaled grads, then the cast back into the half params)."""
    from mpnb.core.ops.triton import launcher

    n = sum(numels)
    p, w, (m, v), steps = _o2_state(numels, dev, 1)
    tp, tw, (tm, tv), tsteps = _o2_state(numels, dev, 1)

    def unscaled():  # mpnb's PyTorch path: fp32 copies of the grads, unscaled
        g32 = [g.float() for g in grads]
        torch._foreach_mul_(g32, inv.reshape(()))
        return g32

    def torch_adamw():
        _adamw(tw, unscaled(), tm, tv, tsteps, found)
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
        COPY,
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

    sgd, first = launcher("fused_sgd_"), [False] * len(p)
    yield case(
        "SGD nesterov O2 bf16",
        work,
        ("torch _fused_sgd_ + unscale + cast", torch_sgd),
        (
            "triton fused_sgd_",
            lambda: sgd(p, grads, m, w, first, _LR, 0.9, 0.0, _WD, True, False, inv, found),
        ),
        20 * n,
        COPY,
        n,
        dev,
    )
    gnorm, lamb = torch.ones(1, device=dev), launcher("fused_lamb_")
    lamb_args = (_LR, _B1, _B2, _EPS, _WD, True, False, True, 1.0, False)
    yield case(
        "LAMB O2 bf16",
        work,
        (
            "torch _foreach_* LAMB + unscale + cast",
            lambda: _foreach_lamb(tp, tw, tm, tv, unscaled()),
        ),
        (
            "triton fused_lamb_",
            lambda: lamb(p, grads, m, v, w, steps, gnorm, *lamb_args, inv, found),
        ),
        28 * n,
        COPY,
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


def _pure_bf16_cases(work, numels, grads, inv, found, dev) -> Iterator[Case]:
    """The pure-bf16 ops (bf16 params, fp32 moments, stochastic rounding) against what their
    CUDA calls run without the kernel: mpnb's reference in PyTorch ops (PyTorch has no
    stochastically rounded optimizer)."""
    from mpnb.core.ops.adam import reference_fused_adam_bf16_
    from mpnb.core.ops.lamb import reference_fused_lamb_bf16_
    from mpnb.core.ops.sgd import reference_fused_sgd_bf16_
    from mpnb.core.ops.triton import launcher

    n, ref = sum(numels), "torch ops (mpnb reference)"
    p, _, (m, v), steps = _o2_state(numels, dev, 2)
    rp, _, (rm, rv), rsteps = _o2_state(numels, dev, 2)
    sr = dict(rounding=_SR[0], seed=_SR[1], rng_step=_SR[2], inv_scale=inv, found_inf=found)
    hyper = dict(lr=_LR, beta1=_B1, beta2=_B2, eps=_EPS, weight_decay=_WD, adam_w_mode=True)
    adam = launcher("fused_adam_bf16_")
    adam_kw = dict(**hyper, bias_correction=True, **sr)
    adam_args = (_LR, _B1, _B2, _EPS, _WD, True, True, *_SR, inv, found)
    yield case(
        "AdamW bf16+SR",
        work,
        (ref, lambda: reference_fused_adam_bf16_(rp, grads, rm, rv, [], rsteps, **adam_kw)),
        ("triton fused_adam_bf16_", lambda: adam(p, grads, m, v, [], steps, *adam_args)),
        22 * n,
        COPY,
        n,
        dev,
    )
    first, sgd = [False] * len(p), launcher("fused_sgd_bf16_")
    sgd_kw = dict(lr=_LR, momentum=0.9, dampening=0.0, weight_decay=_WD, nesterov=True)
    yield case(
        "SGD nesterov bf16+SR",
        work,
        (ref, lambda: reference_fused_sgd_bf16_(rp, grads, rm, [], first, **sgd_kw, **sr)),
        (
            "triton fused_sgd_bf16_",
            lambda: sgd(p, grads, m, [], first, _LR, 0.9, 0.0, _WD, True, False, *_SR, inv, found),
        ),
        14 * n,
        COPY,
        n,
        dev,
    )
    gnorm, lamb = torch.ones(1, device=dev), launcher("fused_lamb_bf16_")
    lamb_kw = dict(bias_correction=False, grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False)
    lamb_args = (_LR, _B1, _B2, _EPS, _WD, True, False, True, 1.0, False, *_SR, inv, found)
    yield case(
        "LAMB bf16+SR",
        work,
        (
            ref,
            lambda: reference_fused_lamb_bf16_(
                rp, grads, rm, rv, [], rsteps, gnorm, **hyper, **lamb_kw, **sr
            ),
        ),
        ("triton fused_lamb_bf16_", lambda: lamb(p, grads, m, v, [], steps, gnorm, *lamb_args)),
        22 * n,
        COPY,
        n,
        dev,
    )


def _o2_step_case(work, numels, grads, inv, dev) -> Case:
    """The whole O2 optimizer step, half grads to half params: torch.amp's (GradScaler's
    unscale into fp32 master grads, then ``AdamW(fused=True)`` on the fp32 masters, then the
    masters cast into the model) against what mpnb's amp O2 step with ``FusedAdam`` launches
    (:data:`O2_STEP_OPS`: the inf/NaN check, then the one-pass Triton AdamW).

    Bytes per param: the least traffic is 28 (read the half grad, the master and both moments,
    write them and the half param); torch's path moves 48 (copy 2+4, unscale 4+4, AdamW 28,
    cast 4+2); mpnb's moves 28 plus its check's (its Triton kernel: 2, read once; without it,
    bf16: ``isfinite().all()`` per tensor, six launches per tensor and about 14; fp16:
    PyTorch's unscale by 1, 2+2).
    """
    from mpnb.core.ops import multi_tensor_check_finite
    from mpnb.core.ops.triton import launcher

    n, half = sum(numels), grads[0].dtype
    name = half_dtype_name(half)
    p, w, (m, v), steps = _o2_state(numels, dev, 3, half)
    tp, tw, (tm, tv), tsteps = _o2_state(numels, dev, 3, half)
    g32 = [torch.empty(k, device=dev) for k in numels]
    tfound, found = torch.zeros(1, device=dev), torch.zeros(1, device=dev)

    def torch_step():  # GradScaler.unscale_ + AdamW(fused=True).step, as torch.optim runs them
        torch._foreach_copy_(g32, grads)
        torch._amp_foreach_non_finite_check_and_unscale_(g32, tfound, inv)
        torch._foreach_add_(tsteps, 1)
        _adamw(tw, g32, tm, tv, tsteps, tfound)
        torch._foreach_sub_(tsteps, [tfound.reshape(())] * len(tsteps))
        torch._foreach_copy_(tp, tw)

    adam = launcher("fused_adam_")

    def mpnb_step():  # FusedOptimizerBase.step under amp's handoff (O2_STEP_OPS)
        multi_tensor_check_finite(found, grads)
        adam(p, grads, m, v, w, steps, _LR, _B1, _B2, _EPS, _WD, True, True, inv, found)

    return case(
        f"O2 step AdamW {name}",
        work,
        ("torch amp unscale_ + _fused_adamw_ + cast (48 B/param)", torch_step),
        ("mpnb amp O2: check_finite + fused_adam_ (triton)", mpnb_step),
        28 * n,
        COPY,
        n,
        dev,
        target=1.5,
    )
