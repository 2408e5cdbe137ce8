"""Plain references of the ``amp_C`` functions that no single mpnb op holds to account, from
what Apex's kernels compute: one tensor at a time, fp32 scalars and math, the roundings those
kernels do (a value assigned to a variable of the params' dtype is rounded to it), norms summed
in fp64. Each is derived from its row of :mod:`mpnb.core._amp_C_table`, as the shims are; the
two LAMB stages, which no mpnb op computes, are the shims too (as an op's reference is its
kernel where it has no other).
"""

from __future__ import annotations

import math

import torch

from mpnb.core._amp_C_table import apex_shim

_F32 = torch.float32


def _f(x) -> torch.Tensor:
    """The fp32 value of a number or of a one-element tensor argument."""
    return x.reshape(-1)[0].float() if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=_F32)


def _r(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (fp32) rounded to ``dtype`` and widened back."""
    return x.to(dtype).float()


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x.double().square().sum().sqrt().float()


def _norms(a, xs) -> tuple[torch.Tensor, torch.Tensor]:
    per = [_norm(x) for x in xs]
    total = _norm(torch.stack(per)) if per else _f(0.0)
    if not math.isfinite(total.item()):
        a.noop_flag.fill_(1)
    return total.reshape(1), (torch.stack(per) if a.per_tensor and per else torch.zeros(0))


@apex_shim
def reference_multi_tensor_l2norm_mp(a):
    """Apex's ``multi_tensor_l2norm_mp``: the norms, or zeros when ``noop_flag`` is set."""
    if a.noop_flag.item() != 0:
        return torch.zeros(1), torch.zeros(len(a.tensors) if a.per_tensor else 0)
    return _norms(a, a.tensors)


@apex_shim
def reference_multi_tensor_l2norm_scale(a):
    """Apex's ``multi_tensor_l2norm_scale``: norms of ``src``, ``dst = src * scale``."""
    for s, d in zip(a.src, a.dst, strict=True):
        d.copy_(s.float() * _f(a.scale))
    return _norms(a, a.src)


@apex_shim
def reference_multi_tensor_lamb_stage1_cuda(a):
    """LAMB's first stage (NVIDIA's BERT): ``[g, p, m, v, update]``.

    With ``c = max(1, |G| / max_global_grad_norm)``, ``t = step + 1`` and the decay ``d`` of
    each tensor: ``m = b1 m + (1-b1) g/c``, ``v = b2 v + (1-b2) (g/c)^2``,
    ``update = (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps) + d p``. Computed in fp32 and, as
    Apex's kernel, rounded to the params' dtype at each of those assignments; ``m``, ``v``
    in place, ``update`` written in its own dtype. ``noop_flag`` is not read (Apex's kernel
    lets inf/NaN through).
    """
    gn, most = float(a.global_grad_norm.reshape(-1)[0]), a.max_global_grad_norm
    clip = _f(gn) / _f(most) if gn > most else _f(1.0)
    b1, b2 = _f(a.beta1), _f(a.beta2)
    bc1, bc2 = 1 - b1 ** float(a.step + 1), 1 - b2 ** float(a.step + 1)
    for i, p in enumerate(a.p):
        dt, decay = p.dtype, a.per_tensor_decay.reshape(-1)[i].to(_F32)
        sg = _r(a.g[i].float() / clip, dt)
        a.m[i].copy_(m := _r(a.m[i].float() * b1 + (1 - b1) * sg, dt))
        a.v[i].copy_(v := _r(a.v[i].float() * b2 + (1 - b2) * sg * sg, dt))
        denom = _r(_r(v / bc2, dt).sqrt() + _f(a.epsilon), dt)
        a.upd[i].copy_(_r(_r(m / bc1, dt) / denom + decay * p.float(), dt))


def _ratio(a, lr, pn, un) -> torch.Tensor:
    """LAMB's trust ratio: ``lr * |p| / |u|``, or ``lr`` (a norm 0, or no decay nor NVLAMB)."""
    if (a.use_nvlamb or a.weight_decay != 0) and pn.item() != 0 and un.item() != 0:
        return lr * (pn.float() / un.float())
    return lr


@apex_shim
def reference_multi_tensor_lamb_stage2_cuda(a):
    """LAMB's second stage: ``[p, update]``, ``p -= r * update``
    with the trust ratio ``r = lr * |p| / |update|`` (``lr`` when a norm is 0, or without decay
    unless ``use_nvlamb``) from the per-tensor norms given (read on the host once); fp32 math,
    ``p`` rounded to its dtype. ``noop_flag`` is not read (as Apex's kernel)."""
    pn = a.per_tensor_param_norm.to("cpu", _F32).reshape(-1)
    un = a.per_tensor_update_norm.to("cpu", _F32).reshape(-1)
    for i, (p, u) in enumerate(zip(a.p, a.upd, strict=True)):
        p.copy_(p.float() - _ratio(a, _f(a.lr), pn[i], un[i]) * u.float())


def _adam(a, m, v, g, b3):
    """Adam's moments of ``g`` (``b3``: the grad's weight in ``m``) and the update they give,
    bias-corrected at step ``a.step`` when ``a.bias_correction``."""
    b1, b2, t = _f(a.beta1), _f(a.beta2), float(_f(a.step))
    bc1, bc2 = (1 - b1**t, 1 - b2**t) if a.bias_correction else (1.0, 1.0)
    m, v = b1 * m.float() + b3 * g, b2 * v.float() + (1 - b2) * g * g
    return m, v, (m / bc1) / ((v / bc2).sqrt() + _f(a.epsilon))


@apex_shim
def reference_multi_tensor_adam_capturable(a):
    """Apex's ``multi_tensor_adam_capturable`` (``[g, p, m, v]``) and, with a fifth list of
    fp32 masters, ``multi_tensor_adam_capturable_master``."""
    g, p, masters = a.grads, a.params, getattr(a, "masters", None)
    if a.noop_flag.item() != 0:
        return
    lr, inv, decay = _f(a.lr), _f(a.inv_scale), _f(a.weight_decay)
    for i in range(len(p)):
        w = masters[i].float() if masters is not None else p[i].float()
        unscaled = g[i].float() * inv  # what the kernel writes back into the grad
        gs = unscaled + decay * w if a.mode == 0 else unscaled
        mi, vi, update = _adam(a, a.exp_avgs[i], a.exp_avg_sqs[i], gs, 1 - _f(a.beta1))
        w = w - lr * (update + decay * w if a.mode == 1 else update)
        if masters is None:  # Apex's kernel stores these moments rounded to the params' dtype
            mi, vi = _r(mi, p[i].dtype), _r(vi, p[i].dtype)
        else:
            masters[i].copy_(w)
        for dst, src in ((p, w), (a.exp_avgs, mi), (a.exp_avg_sqs, vi), (g, unscaled)):
            dst[i].copy_(src)


reference_multi_tensor_adam_capturable_master = apex_shim(
    reference_multi_tensor_adam_capturable.body, "reference_multi_tensor_adam_capturable_master"
)


@apex_shim
def reference_multi_tensor_lamb_mp(a):
    """Apex's ``multi_tensor_lamb_mp``: ``[g, p, m, v]`` or ``[g, p_master, m, v, p_model]``
    (the update is not written into the grads here)."""
    if a.noop_flag.item() != 0 or a.found_inf.item() != 0:
        return
    b3 = 1 - _f(a.beta1) if a.grad_averaging else _f(1.0)
    gn, mx = _f(a.global_grad_norm), _f(a.max_grad_norm)
    clip = gn / mx if gn.item() > mx.item() else _f(1.0)
    inv, lr, decay = _f(a.inv_scale), _f(a.lr), _f(a.weight_decay)
    for i, w in enumerate(a.w):
        p = w.float()
        sg = a.grads[i].float() * inv / clip
        sg = sg + decay * p if a.mode == 0 else sg
        mi, vi, u = _adam(a, a.exp_avgs[i], a.exp_avg_sqs[i], sg, b3)
        u = u + decay * p if a.mode == 1 else u
        new = p - _ratio(a, lr, _norm(p), _norm(u)) * u
        for dst, src in ((a.w, new), (a.model, new), (a.exp_avgs, mi), (a.exp_avg_sqs, vi)):
            if dst is not None:
                dst[i].copy_(src)


__all__ = sorted(n for n in dir() if n.startswith("reference_"))  # each defined above
