"""The ``cuda`` bench suite's tensor-list cases: the unscale, the L2 norm, the optimizer steps.

See :mod:`mpnb.lab.bench.cuda` for the method. Every case holds the same bf16 grads (seeded,
``randn * 1e-3``: finite, so no step is skipped) and its own optimizer state per side, so both
sides do the same work on every call.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import NamedTuple

import torch

from mpnb.core.dtype_names import half_dtype_name
from mpnb.core.ops import multi_tensor_check_finite
from mpnb.core.ops.adam import reference_fused_adam_bf16_
from mpnb.core.ops.check_finite import reference_multi_tensor_check_finite
from mpnb.core.ops.lamb import reference_fused_lamb_bf16_
from mpnb.core.ops.sgd import reference_fused_sgd_bf16_
from mpnb.core.ops.triton import launcher
from mpnb.lab.bench._cuda_layers import TritonRow, case, randn, walk
from mpnb.lab.bench._harness import COPY, READ, Case

__all__ = ["list_cases", "O2_STEP_OPS"]

_LR, _B1, _B2, _EPS, _WD = 1e-4, 0.9, 0.999, 1e-8, 0.01
#: Each optimizer's scalars, by the names of its op's reference (the O2 and pure-bf16 cases).
_ADAMW = dict(
    lr=_LR, beta1=_B1, beta2=_B2, eps=_EPS, weight_decay=_WD, adam_w_mode=True, bias_correction=True
)
_SGD = dict(
    lr=_LR, momentum=0.9, dampening=0.0, weight_decay=_WD, nesterov=True, wd_after_momentum=False
)
_LAMB = dict(
    lr=_LR,
    beta1=_B1,
    beta2=_B2,
    eps=_EPS,
    weight_decay=_WD,
    adam_w_mode=True,
    bias_correction=False,
    grad_averaging=True,
    max_grad_norm=1.0,
    use_nvlamb=False,
)
_SR = dict(rounding="stochastic", seed=1, rng_step=1)  # the pure-bf16 ops' rounding
#: The ``mpnb::`` ops an amp O2 step with ``FusedAdam`` dispatches over the param lists, in
#: order (``optimizer.step()`` under a handed-over loss scale): the read-only inf/NaN check of
#: the half grads, then the one-pass AdamW. The "O2 step" case runs exactly these; a test
#: holds the real step to this list.
O2_STEP_OPS = ("multi_tensor_check_finite", "fused_adam_")


class _State(NamedTuple):
    """One side's optimizer state: half params, fp32 masters (random), moments and steps."""

    params: list[torch.Tensor]
    masters: list[torch.Tensor]
    m: list[torch.Tensor]
    v: list[torch.Tensor]
    steps: list[torch.Tensor]


def _o2_state(numels, dev, seed, half=torch.bfloat16) -> _State:
    masters = randn(numels, torch.float32, dev, seed)
    params = [w.to(half) for w in masters]
    m, v = ([torch.zeros_like(w) for w in masters] for _ in range(2))
    return _State(params, masters, m, v, [torch.zeros((), device=dev) for _ in numels])


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


def _torch_unscale(w: SimpleNamespace) -> None:
    torch._foreach_copy_(w.master_grads, w.grads)
    torch._amp_foreach_non_finite_check_and_unscale_(w.master_grads, w.found, w.inv)


def _fp16_grads(w: SimpleNamespace) -> None:
    """The grads in fp16 too (None without ``fp16_step``)."""
    w.half = [g.to(torch.float16) for g in w.grads] if w.fp16_step else None


def _o2_states(w: SimpleNamespace) -> None:
    """The O2 cases' state, mpnb's (``w.ours``) and PyTorch's (``w.theirs``), the same."""
    w.ours, w.theirs = _o2_state(w.numels, w.dev, 1), _o2_state(w.numels, w.dev, 1)


def _bf16_states(w: SimpleNamespace) -> None:
    """The pure-bf16 cases' state (bf16 params, fp32 moments; no masters), replacing the O2's."""
    w.ours, w.theirs = _o2_state(w.numels, w.dev, 2), _o2_state(w.numels, w.dev, 2)


def _unscaled(w: SimpleNamespace) -> list[torch.Tensor]:
    # mpnb's PyTorch path: fp32 copies of the grads, unscaled
    g32 = [g.float() for g in w.grads]
    torch._foreach_mul_(g32, w.inv.reshape(()))
    return g32


def _torch_adamw(w: SimpleNamespace) -> None:
    t = w.theirs
    _adamw(t.masters, _unscaled(w), t.m, t.v, t.steps, w.found)
    torch._foreach_copy_(t.params, t.masters)


def _torch_sgd(w: SimpleNamespace) -> None:
    t = w.theirs
    torch._fused_sgd_(
        t.masters,
        _unscaled(w),
        t.m,
        weight_decay=_WD,
        momentum=0.9,
        lr=_LR,
        dampening=0.0,
        nesterov=True,
        maximize=False,
        is_first_step=False,
        found_inf=w.found,
    )
    torch._foreach_copy_(t.params, t.masters)


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


_REF = "torch ops (mpnb reference)"


def _on(state: str, lists, scalars: dict):
    """``call(w, f)``: the optimizer op ``f`` (its launcher or its reference) on the state
    ``w.<state>`` (``"ours"`` or ``"theirs"``): the op's lists, ``lists(w, state)``, by
    position, then ``scalars`` and the loss scale's tensors by keyword."""

    def call(w, f):
        return f(*lists(w, getattr(w, state)), **scalars, inv_scale=w.inv, found_inf=w.found)

    return call


def _pure_bf16(name, reference, op, lists, scalars, nbytes) -> TritonRow:
    """A pure-bf16 case: the Triton kernel on mpnb's state against the same call of the op's
    reference in PyTorch ops on PyTorch's (stochastic rounding, :data:`_SR`)."""
    ref = _on("theirs", lists, scalars | _SR)
    return TritonRow(
        name, (_REF, lambda w: ref(w, reference)), op, _on("ours", lists, scalars | _SR), nbytes
    )


# Every case holds the same bf16 grads; bytes per element of the list.
#
# * the check: against what its CUDA calls run without the kernel, for bf16 mpnb's reference
#   in PyTorch ops (PyTorch's fused check refuses bf16), for fp16 PyTorch's
#   ``_amp_foreach_non_finite_check_and_unscale_`` by exactly 1.0 (it writes the grads back);
# * the optimizer ops with fp32 masters (O2): against the op's PyTorch path on CUDA (PyTorch's
#   fused op on fp32 copies of the unscaled grads, then the cast back into the half params);
# * the pure-bf16 ops (bf16 params, fp32 moments, stochastic rounding): against what their CUDA
#   calls run without the kernel, mpnb's reference in PyTorch ops (PyTorch has no
#   stochastically rounded optimizer).
_LISTS = (
    TritonRow(
        "unscale bf16->fp32",
        ("torch foreach_copy_ + amp unscale_", _torch_unscale),
        "multi_tensor_scale",
        lambda w, k: k(w.found, w.grads, w.master_grads, scale=1.0, scale_tensor=w.inv),
        6,
    ),
    TritonRow(
        "l2norm bf16",
        (
            "torch _foreach_norm + norm",
            lambda w: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(w.grads))),
        ),
        "multi_tensor_l2norm",
        lambda w, k: k(w.found, w.grads),
        2,
        READ,
    ),
    _fp16_grads,
    TritonRow(
        "check_finite bf16",
        (
            "torch ops (mpnb reference: isfinite().all() per tensor)",
            lambda w: reference_multi_tensor_check_finite(w.found, w.grads),
        ),
        "multi_tensor_check_finite",
        lambda w, k: k(w.found, w.grads),
        2,
        READ,
    ),
    TritonRow(
        "check_finite fp16",
        (
            "torch amp unscale_ by 1.0 (reads and writes)",
            lambda w: torch._amp_foreach_non_finite_check_and_unscale_(w.half, w.found, w.one),
        ),
        "multi_tensor_check_finite",
        lambda w, k: k(w.found, w.half),
        2,
        READ,
        needs="half",
    ),
    _o2_states,
    TritonRow(
        "AdamW O2 bf16",
        ("torch _fused_adamw_ + unscale + cast", _torch_adamw),
        "fused_adam_",
        _on("ours", lambda w, s: (s.params, w.grads, s.m, s.v, s.masters, s.steps), _ADAMW),
        28,
    ),
    TritonRow(
        "SGD nesterov O2 bf16",
        ("torch _fused_sgd_ + unscale + cast", _torch_sgd),
        "fused_sgd_",
        _on("ours", lambda w, s: (s.params, w.grads, s.m, s.masters, w.first), _SGD),
        20,
    ),
    TritonRow(
        "LAMB O2 bf16",
        (
            "torch _foreach_* LAMB + unscale + cast",
            lambda w: _foreach_lamb(*w.theirs[:4], _unscaled(w)),  # params, masters, m, v
        ),
        "fused_lamb_",
        _on(
            "ours",
            lambda w, s: (s.params, w.grads, s.m, s.v, s.masters, s.steps, w.gnorm),
            _LAMB,
        ),
        28,
    ),
    _bf16_states,
    _pure_bf16(
        "AdamW bf16+SR",
        reference_fused_adam_bf16_,
        "fused_adam_bf16_",
        lambda w, s: (s.params, w.grads, s.m, s.v, [], s.steps),
        _ADAMW,
        22,
    ),
    _pure_bf16(
        "SGD nesterov bf16+SR",
        reference_fused_sgd_bf16_,
        "fused_sgd_bf16_",
        lambda w, s: (s.params, w.grads, s.m, [], w.first),
        _SGD,
        14,
    ),
    _pure_bf16(
        "LAMB bf16+SR",
        reference_fused_lamb_bf16_,
        "fused_lamb_bf16_",
        lambda w, s: (s.params, w.grads, s.m, s.v, [], s.steps, w.gnorm),
        _LAMB,
        22,
    ),
)


def list_cases(work: str, numels: list[int], dev: str, fp16_step: bool = True) -> Iterator[Case]:
    """Every list kernel on one list of ``numels`` (:data:`_LISTS`): unscale, L2 norm, the
    inf/NaN check, the O2 steps (AdamW, SGD, LAMB with fp32 masters), the pure-bf16 steps
    (stochastic rounding), then the whole O2 step of mpnb's amp against torch's (bf16 grads;
    the check and the whole step in fp16 too with ``fp16_step``)."""
    grads = randn(numels, torch.bfloat16, dev, 0, 1e-3)
    w = SimpleNamespace(numels=numels, n=sum(numels), grads=grads, dev=dev, fp16_step=fp16_step)
    w.master_grads = [torch.empty(k, device=dev) for k in numels]
    w.found, w.one = torch.zeros(1, device=dev), torch.ones(1, device=dev)
    w.gnorm = torch.ones(1, device=dev)  # LAMB's global grad norm
    w.inv = torch.full((1,), 1 / 65536, device=dev)
    w.first = [False] * len(numels)
    yield from walk(_LISTS, w, work, dev)
    yield _o2_step_case(work, numels, grads, w.inv, dev)
    if w.half is not None:
        yield _o2_step_case(work, numels, w.half, w.inv, dev)


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
    n, half = sum(numels), grads[0].dtype
    name = half_dtype_name(half)
    p, w, m, v, steps = _o2_state(numels, dev, 3, half)
    tp, tw, tm, tv, tsteps = _o2_state(numels, dev, 3, half)
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
        adam(p, grads, m, v, w, steps, **_ADAMW, inv_scale=inv, found_inf=found)

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
