"""Apex's ``amp_C`` extension module, with Apex's signatures, on mpnb's kernels.

Code that calls ``amp_C.multi_tensor_l2norm(chunk_size, noop_flag, [tensors], per_tensor)``
directly (Megatron does) runs unchanged against ``mpnb.amp_C``. All 17 of Apex's functions are
here (and ``multi_tensor_check_finite``, an mpnb addition). Each is a row of
:mod:`mpnb.core._amp_C_table` (Apex's positional names, its tensor lists, the mpnb op) and a
body below that reads the call by name; :func:`~mpnb.core._amp_C_table.apex_shim` joins them.
:mod:`mpnb.core.amp_C_reference` holds plain references, which the tests hold these to.

Apex passes the step count as a number; mpnb's ops keep it in per-param tensors. A set
``noop_flag`` on entry writes nothing. Tensor arguments Apex reads on the device (``lr``,
``step``, ``inv_scale`` of the capturable and mixed-precision forms) are read once on the host:
CUDA graphs capture PyTorch's own capturable optimizers, not these.
"""

from __future__ import annotations

import contextlib

import torch

from mpnb.core import ops as _mt
from mpnb.core._amp_C_table import ROWS, apex_shim, call_op, value

__all__ = [*ROWS, "update_scale_hysteresis"]
_F32 = torch.float32


def _is_set(flag: torch.Tensor) -> bool:
    """Whether a flag tensor (``noop_flag``, ``found_inf``) is non-zero."""
    return bool(flag.reshape(-1)[0].item() != 0)


def _check_step(op: str, step, bias_correction) -> None:
    """Refuse ``step < 1`` with bias correction, before anything is written.

    The bias correction ``1 - beta**step`` is 0 at step 0 (negative below it), so the update
    would divide by zero and every param become NaN or inf; Apex's kernel does exactly that,
    silently. Apex's optimizers count steps from 1 (they add 1 before the call); a caller that
    passes 0 has forgotten to. Refused rather than warned: a warning would still leave every
    weight NaN.
    """
    if bias_correction and value(step) < 1:
        raise ValueError(
            f"amp_C.{op}: step={value(step):g} with bias_correction=1: the bias correction "
            "1 - beta**step is 0 at step 0 (negative below), so every param would become "
            "NaN/inf. Count steps from 1, as Apex's optimizers do (step += 1 before the call), "
            "or pass bias_correction=0. Nothing was written."
        )


def _steps(step, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-param step tensors holding ``step - 1``: mpnb's ops keep the count per param and
    advance it themselves, where Apex passes the count after this step."""
    dev = like[0].device if like else torch.device("cpu")
    return [torch.full((), value(step) - 1.0, device=dev) for _ in like]


@contextlib.contextmanager
def _fp32_state():
    """Apex keeps the state of half params without masters in the param dtype; mpnb's ops keep
    fp32 state. ``fp32(lst)`` gives an fp32 copy (the list itself when it is fp32) that is
    written back at the end: fp32 math and one rounding store, as Apex's kernels."""
    back: list = []

    def fp32(lst: list[torch.Tensor]) -> list[torch.Tensor]:
        if lst and lst[0].dtype != torch.float32:
            back.append((lst, [t.float() for t in lst]))
            return back[-1][1]
        return lst

    yield fp32
    for lst, f in back:
        torch._foreach_copy_(lst, f)


#: Apex's loss-scale update with hysteresis: the op itself has Apex's signature and names
update_scale_hysteresis = _mt.update_scale_hysteresis


@apex_shim
def multi_tensor_scale(a):
    """``[src, dst]``: ``dst = src * scale``, flag non-finite ``src`` values."""
    call_op(_mt.multi_tensor_scale, a)


@apex_shim
def multi_tensor_axpby(a):
    """``[x, y, out]``: ``out = a*x + b*y``; ``arg_to_check`` -1/0/1 as in Apex."""
    call_op(_mt.multi_tensor_axpby, a)


@apex_shim
def multi_tensor_l2norm(a):
    """``[tensors]``: ``(global_norm[1], per_tensor_norms[n or 0])``."""
    return call_op(_mt.multi_tensor_l2norm, a)


@apex_shim
def multi_tensor_unscale_l2norm(a):
    """Norms of ``tensors * inv_scale`` without modifying the tensors (grad clipping under amp)."""
    inv = a.inv_scale
    inv = inv if isinstance(inv, torch.Tensor) else torch.tensor([float(inv)], dtype=_F32)
    return call_op(_mt.multi_tensor_l2norm, a, inv_scale=inv)


@apex_shim
def multi_tensor_check_finite(a):
    """``[tensors]``: read-only inf/NaN check (an mpnb addition to amp_C)."""
    call_op(_mt.multi_tensor_check_finite, a)


@apex_shim
def multi_tensor_l2norm_mp(a):
    """As :func:`multi_tensor_l2norm`, but a set ``noop_flag`` on entry skips the work (the step
    is skipped anyway): the norms are then zeros (Apex leaves them unset)."""
    if _is_set(a.noop_flag):
        dev = a.tensors[0].device if a.tensors else a.noop_flag.device
        n = len(a.tensors) if a.per_tensor else 0
        return torch.zeros(1, device=dev), torch.zeros(n, device=dev)
    return call_op(_mt.multi_tensor_l2norm, a)


@apex_shim
def multi_tensor_l2norm_scale(a):
    """``[src, dst]``: the L2 norms of ``src`` (not scaled) and ``dst = src * scale``; a
    non-finite ``src`` sets ``noop_flag``."""
    norms = call_op(_mt.multi_tensor_l2norm, a, tensors=a.src)
    call_op(_mt.multi_tensor_scale, a)
    return norms


def _f32(x: float) -> float:
    """``x`` rounded to fp32, as the kernel holds its float arguments."""
    return float(torch.tensor(x, dtype=_F32))


def _fp32s(xs: list[torch.Tensor], dtype: torch.dtype = _F32) -> list[torch.Tensor]:
    """``xs`` in fp32, rounded to ``dtype`` first (Apex's stores into the params' dtype)."""
    return [x.to(dtype).float() for x in xs]


@apex_shim
def multi_tensor_lamb_stage1_cuda(a):
    """LAMB's first stage (NVIDIA's BERT): ``[g, p, m, v, update]``.

    With ``c = max(1, |G| / max_global_grad_norm)``, ``t = step + 1`` and the decay ``d`` of
    each tensor: ``m = b1 m + (1-b1) g/c``, ``v = b2 v + (1-b2) (g/c)^2``,
    ``update = (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps) + d p``. Computed in fp32 and, as
    Apex's kernel, rounded to the params' dtype at each of those assignments; ``m``, ``v``
    in place, ``update`` written in its own dtype. ``noop_flag`` is not read (Apex's kernel
    lets inf/NaN through).
    """
    if not a.p:
        return
    dt, fo = a.p[0].dtype, torch._foreach_add
    gnorm, most = value(a.global_grad_norm), a.max_global_grad_norm
    clip = _f32(gnorm / most) if gnorm > most else 1.0
    b1, b2, t = _f32(a.beta1), _f32(a.beta2), a.step + 1
    bc1, bc2 = _f32(1.0 - _f32(b1**t)), _f32(1.0 - _f32(b2**t))
    sg = _fp32s(torch._foreach_div(_fp32s(a.g), clip), dt)
    m = _fp32s(fo(torch._foreach_mul(_fp32s(a.m), b1), torch._foreach_mul(sg, _f32(1 - b1))), dt)
    sq = torch._foreach_mul(torch._foreach_mul(sg, _f32(1 - b2)), sg)
    v = _fp32s(fo(torch._foreach_mul(_fp32s(a.v), b2), sq), dt)
    mh = _fp32s(torch._foreach_div(m, bc1), dt)
    vh = torch._foreach_sqrt(_fp32s(torch._foreach_div(v, bc2), dt))
    denom = _fp32s(fo(vh, _f32(a.epsilon)), dt)
    decayed = torch._foreach_mul(_fp32s(a.p), a.per_tensor_decay.to(_F32).reshape(-1).tolist())
    torch._foreach_copy_(a.m, m)
    torch._foreach_copy_(a.v, v)
    torch._foreach_copy_(a.upd, _fp32s(fo(torch._foreach_div(mh, denom), decayed), dt))


@apex_shim
def multi_tensor_lamb_stage2_cuda(a):
    """LAMB's second stage: ``[p, update]``, ``p -= r * update`` with the trust ratio
    ``r = lr * |p| / |update|`` (``lr`` when a norm is 0, or without decay unless
    ``use_nvlamb``), from the per-tensor norms given; fp32 math, ``p`` rounded to its dtype.
    ``noop_flag`` is not read (as Apex's kernel)."""
    if not a.p:
        return
    lr = torch.tensor(_f32(a.lr), dtype=_F32)
    pn = a.per_tensor_param_norm.to("cpu", _F32).reshape(-1)
    un = a.per_tensor_update_norm.to("cpu", _F32).reshape(-1)
    adaptive = bool(a.use_nvlamb) or a.weight_decay != 0.0
    trust = [adaptive and pn[i].item() != 0.0 and un[i].item() != 0.0 for i in range(len(a.p))]
    ratios = [float(lr * (pn[i] / un[i])) if t else float(lr) for i, t in enumerate(trust)]
    torch._foreach_copy_(
        a.p, torch._foreach_sub(_fp32s(a.p), torch._foreach_mul(_fp32s(a.upd), ratios))
    )


def _adam(a, name: str, capturable: bool) -> None:
    _check_step(name, a.step, a.bias_correction)
    if capturable and (not a.params or _is_set(a.noop_flag)):
        return
    p, masters = a.params, getattr(a, "masters", [])
    inv = a.inv_scale.reshape(1).to(_F32) if capturable else None
    with _fp32_state() as fp32:
        call_op(
            _mt.fused_adam_,
            a,
            exp_avgs=fp32(a.exp_avgs),
            exp_avg_sqs=fp32(a.exp_avg_sqs),
            masters=masters,
            steps=_steps(a.step, p),
            adam_w_mode=a.mode == 1,
            inv_scale=inv,
            found_inf=None if capturable else a.noop_flag,
        )
    if capturable and not masters and p[0].dtype != _F32:  # Apex: moments rounded to p's dtype
        for x in (*a.exp_avgs, *a.exp_avg_sqs):
            x.copy_(x.to(p[0].dtype))
    if capturable:
        torch._foreach_mul_(a.grads, inv.reshape(()).to(a.grads[0].device))  # Apex: unscaled


@apex_shim
def multi_tensor_adam(a):
    """``[grads, params, exp_avgs, exp_avg_sqs]``; ``mode`` 0 = Adam (L2), 1 = AdamW.

    ``step`` is the count after this step (1 at the first); with ``bias_correction`` a step
    below 1 is refused (:func:`_check_step`), where Apex's kernel
    writes NaN."""
    _adam(a, "multi_tensor_adam", capturable=False)


@apex_shim
def multi_tensor_adam_capturable(a):
    """``[grads, params, exp_avgs, exp_avg_sqs]``: Adam (``mode`` 0, L2) or AdamW (1) with
    ``lr``, ``step`` (the count after this step) and ``inv_scale`` as tensors; the grads are
    unscaled (``g *= inv_scale``, as Apex's kernel leaves them); a set ``noop_flag`` writes
    nothing. Half params keep fp32 moments rounded to their dtype (as Apex's kernel)."""
    _adam(a, "multi_tensor_adam_capturable", capturable=True)


@apex_shim
def multi_tensor_adam_capturable_master(a):
    """As :func:`multi_tensor_adam_capturable` with a fifth list, the fp32 master weights:
    the masters are updated and the (half) params receive their rounded copy."""
    _adam(a, "multi_tensor_adam_capturable_master", capturable=True)


@apex_shim
def multi_tensor_sgd(a):
    """``[grads, params, momentum_buffers]`` or, with fp16 model copies, ``[..., model_params]``
    (then ``params`` are the fp32 masters); grads are multiplied by ``scale`` first."""
    params, masters = (a.w, []) if a.model is None else (a.model, a.w)
    inv = None if float(a.scale) == 1.0 else torch.tensor([float(a.scale)], dtype=_F32)
    with _fp32_state() as fp32:
        call_op(
            _mt.fused_sgd_,
            a,
            params=params,
            momentum_buffers=fp32(a.momentum_buffers),
            masters=masters,
            first_run=[bool(a.first_run)] * len(params),
            weight_decay=a.wd,
            inv_scale=inv,
        )


def _lamb(a, name: str, params: list, masters: list, mp: bool) -> None:
    _check_step(name, a.step, a.bias_correction)
    if mp and (not params or _is_set(a.noop_flag) or _is_set(a.found_inf)):
        return
    with _fp32_state() as fp32:
        call_op(
            _mt.fused_lamb_,
            a,
            params=params,
            exp_avgs=fp32(a.exp_avgs),
            exp_avg_sqs=fp32(a.exp_avg_sqs),
            masters=masters,
            steps=_steps(a.step, params),
            global_grad_norm=a.global_grad_norm.reshape(1).to(_F32) if mp else a.global_grad_norm,
            adam_w_mode=a.mode == 1,
            inv_scale=a.inv_scale.reshape(1).to(_F32) if mp else None,
            found_inf=None if mp else a.noop_flag,
        )


@apex_shim
def multi_tensor_lamb(a):
    """``[grads, params, exp_avgs, exp_avg_sqs]``; ``mode`` 0 = L2 decay, 1 = decoupled."""
    _lamb(a, "multi_tensor_lamb", a.params, [], mp=False)


@apex_shim
def multi_tensor_lamb_mp(a):
    """Apex's FusedMixedPrecisionLamb step: ``[g, p, m, v]`` (params updated directly, moments
    in their dtype) or ``[g, p_master, m, v, p_model]`` (fp32 masters updated, the model's
    half params get their rounded copy). ``lr``, ``step`` (the count after this step),
    ``global_grad_norm`` and ``max_grad_norm`` (both of the *scaled* grads), ``found_inf`` and
    ``inv_scale`` are tensors; ``mode`` 0 = L2 decay, 1 = decoupled. A set ``noop_flag`` or
    ``found_inf`` writes nothing. The grads are left as they are (Apex's kernel writes the
    update into them)."""
    params, masters = (a.w, []) if a.model is None else (a.model, a.w)
    _lamb(a, "multi_tensor_lamb_mp", params, masters, mp=True)


@apex_shim
def multi_tensor_novograd(a):
    """``[grads, params, exp_avgs]``; ``grad_norms`` holds the per-tensor second moments and
    is blended with this step's grad norms in place (Apex); ``mode`` 0 = reg inside moment."""
    _check_step("multi_tensor_novograd", a.step, a.bias_correction)
    if a.norm_type == 2:
        flag = torch.zeros(1, device=a.grad_norms.device)
        norms = _mt.multi_tensor_l2norm(flag, a.grads, True)[1].float()
    else:
        norms = torch.stack([x.abs().max().float() for x in a.grads])
    with _fp32_state() as fp32:
        call_op(
            _mt.fused_novograd_,
            a,
            exp_avgs=fp32(a.exp_avgs),
            exp_avg_sqs=list(a.grad_norms.unbind()),
            masters=[],
            steps=_steps(a.step, a.params),
            grad_norms=norms.contiguous(),
            reg_inside_moment=a.mode == 0,
            init_zero=True,
        )


@apex_shim
def multi_tensor_adagrad(a):
    """``[grads, params, sums]``; ``mode`` 0 = L2 decay, 1 = decoupled (adagrad_w_mode)."""
    with _fp32_state() as fp32:
        call_op(
            _mt.fused_adagrad_,
            a,
            sums=fp32(a.sums),
            masters=[],
            steps=_steps(1, a.params),
            adagrad_w_mode=a.mode == 1,
        )
