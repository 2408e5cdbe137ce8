"""Plain references of the ``amp_C`` functions of :mod:`mpnb.core._amp_C_mp`, written from what
Apex's kernels compute: one tensor at a time, fp32 scalars and math, the roundings those
kernels do (a value assigned to a variable of the params' dtype is rounded to it), and norms
summed in fp64. The tests hold :mod:`mpnb.amp_C` to these on every dtype.

Same signatures as the ``amp_C`` functions, with ``reference_`` in front of the name.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "reference_multi_tensor_l2norm_mp",
    "reference_multi_tensor_l2norm_scale",
    "reference_multi_tensor_lamb_stage1_cuda",
    "reference_multi_tensor_lamb_stage2_cuda",
    "reference_multi_tensor_adam_capturable",
    "reference_multi_tensor_adam_capturable_master",
    "reference_multi_tensor_lamb_mp",
]

_F32 = torch.float32


def _f(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=_F32)


def _r(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (fp32) rounded to ``dtype`` and widened back."""
    return x.to(dtype).float()


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x.double().square().sum().sqrt().float()


def _norms(xs, per_tensor) -> tuple[torch.Tensor, torch.Tensor]:
    per = [_norm(x) for x in xs]
    total = torch.stack(per).double().square().sum().sqrt().float() if per else _f(0.0)
    return total.reshape(1), (torch.stack(per) if per_tensor and per else torch.zeros(0))


def _flag(noop, bad: bool) -> None:
    if bad:
        noop.fill_(1)


def reference_multi_tensor_l2norm_mp(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """Apex's ``multi_tensor_l2norm_mp``: the norms, or zeros when ``noop_flag`` is set."""
    (x,) = tensor_lists
    if noop_flag.item() != 0:
        return torch.zeros(1), torch.zeros(len(x) if per_tensor else 0)
    total, per = _norms(x, per_tensor)
    _flag(noop_flag, not math.isfinite(total.item()))
    return total, per


def reference_multi_tensor_l2norm_scale(chunk_size, noop_flag, tensor_lists, scale, per_tensor):
    """Apex's ``multi_tensor_l2norm_scale``: norms of ``src``, ``dst = src * scale``."""
    src, dst = tensor_lists
    total, per = _norms(src, per_tensor)
    for s, d in zip(src, dst, strict=True):
        d.copy_(s.float() * _f(scale))
    _flag(noop_flag, not math.isfinite(total.item()))
    return total, per


def reference_multi_tensor_lamb_stage1_cuda(
    chunk_size,
    noop_flag,
    tensor_lists,
    per_tensor_decay,
    step,
    beta1,
    beta2,
    epsilon,
    global_grad_norm,
    max_global_grad_norm,
) -> None:
    """Apex's ``multi_tensor_lamb_stage1_cuda``: ``[g, p, m, v, update]``."""
    g, p, m, v, upd = tensor_lists
    gn = float(global_grad_norm.reshape(-1)[0])
    clip = _f(gn) / _f(max_global_grad_norm) if gn > max_global_grad_norm else _f(1.0)
    b1, b2 = _f(beta1), _f(beta2)
    bc1 = _f(1.0) - b1 ** float(step + 1)
    bc2 = _f(1.0) - b2 ** float(step + 1)
    for i in range(len(p)):
        dt = p[i].dtype
        decay = per_tensor_decay.reshape(-1)[i].to(_F32)
        sg = _r(g[i].float() / clip, dt)
        mi = _r(m[i].float() * b1 + (_f(1.0) - b1) * sg, dt)
        vi = _r(v[i].float() * b2 + (_f(1.0) - b2) * sg * sg, dt)
        denom = _r(_r(vi / bc2, dt).sqrt() + _f(epsilon), dt)
        u = _r(_r(mi / bc1, dt) / denom + decay * p[i].float(), dt)
        m[i].copy_(mi)
        v[i].copy_(vi)
        upd[i].copy_(u)


def reference_multi_tensor_lamb_stage2_cuda(
    chunk_size,
    noop_flag,
    tensor_lists,
    per_tensor_param_norm,
    per_tensor_update_norm,
    lr,
    weight_decay,
    use_nvlamb=False,
) -> None:
    """Apex's ``multi_tensor_lamb_stage2_cuda``: ``[p, update]``."""
    p, upd = tensor_lists
    for i in range(len(p)):
        ratio = _f(lr)
        pn, un = per_tensor_param_norm.reshape(-1)[i], per_tensor_update_norm.reshape(-1)[i]
        if (use_nvlamb or weight_decay != 0) and pn.item() != 0 and un.item() != 0:
            ratio = _f(lr) * (pn.float() / un.float())
        p[i].copy_(p[i].float() - ratio * upd[i].float())


def _adam(g, w, m, v, lr, beta1, beta2, eps, step, mode, bias_correction, decay, inv):
    b1, b2 = _f(beta1), _f(beta2)
    bc1 = _f(1.0) - b1 ** float(step) if bias_correction else _f(1.0)
    bc2 = _f(1.0) - b2 ** float(step) if bias_correction else _f(1.0)
    unscaled = g.float() * inv  # what the kernel writes back into the grad
    gs = unscaled + _f(decay) * w if mode == 0 else unscaled
    m = b1 * m + (_f(1.0) - b1) * gs
    v = b2 * v + (_f(1.0) - b2) * gs * gs
    update = (m / bc1) / ((v / bc2).sqrt() + _f(eps))
    if mode == 1:
        update = update + _f(decay) * w
    return w - lr * update, m, v, unscaled


def _capturable(tensor_lists, noop_flag, lr, b1, b2, eps, step, mode, bc, decay, inv_scale):
    g, p, m, v = tensor_lists[:4]
    masters = tensor_lists[4] if len(tensor_lists) == 5 else None
    if noop_flag.item() != 0:
        return
    lr32, inv = lr.reshape(-1)[0].float(), inv_scale.reshape(-1)[0].float()
    for i in range(len(p)):
        w = masters[i].float() if masters is not None else p[i].float()
        w, mi, vi, gs = _adam(
            g[i], w, m[i].float(), v[i].float(), lr32, b1, b2, eps, int(step), mode, bc, decay, inv
        )
        if masters is None:  # Apex's kernel stores these moments rounded to the params' dtype
            mi, vi = _r(mi, p[i].dtype), _r(vi, p[i].dtype)
        else:
            masters[i].copy_(w)
        p[i].copy_(w)
        m[i].copy_(mi)
        v[i].copy_(vi)
        g[i].copy_(gs)


def reference_multi_tensor_adam_capturable(
    chunk_size,
    noop_flag,
    tensor_lists,
    lr,
    beta1,
    beta2,
    epsilon,
    step,
    mode,
    bias_correction,
    weight_decay,
    inv_scale,
) -> None:
    """Apex's ``multi_tensor_adam_capturable`` (``[g, p, m, v]``) and, with a fifth list of
    fp32 masters, ``multi_tensor_adam_capturable_master``."""
    _capturable(
        tensor_lists,
        noop_flag,
        lr,
        beta1,
        beta2,
        epsilon,
        step,
        mode,
        bias_correction,
        weight_decay,
        inv_scale,
    )


#: the master form is the same computation with the fifth list
reference_multi_tensor_adam_capturable_master = reference_multi_tensor_adam_capturable


def reference_multi_tensor_lamb_mp(
    chunk_size,
    noop_flag,
    tensor_lists,
    lr,
    beta1,
    beta2,
    epsilon,
    step,
    bias_correction,
    weight_decay,
    grad_averaging,
    mode,
    global_grad_norm,
    max_grad_norm,
    use_nvlamb,
    found_inf,
    inv_scale,
) -> None:
    """Apex's ``multi_tensor_lamb_mp``: ``[g, p, m, v]`` or ``[g, p_master, m, v, p_model]``
    (the update is not written into the grads here)."""
    g, w, m, v = tensor_lists[:4]
    model = tensor_lists[4] if len(tensor_lists) == 5 else None
    if noop_flag.item() != 0 or found_inf.item() != 0:
        return
    b1, b2 = _f(beta1), _f(beta2)
    b3 = _f(1.0) - b1 if grad_averaging else _f(1.0)
    t = float(step.reshape(-1)[0])
    bc1 = _f(1.0) - b1**t if bias_correction else _f(1.0)
    bc2 = _f(1.0) - b2**t if bias_correction else _f(1.0)
    gn, mx = global_grad_norm.reshape(-1)[0].float(), max_grad_norm.reshape(-1)[0].float()
    clip = gn / mx if gn.item() > mx.item() else _f(1.0)
    inv, lr32, decay = inv_scale.reshape(-1)[0].float(), lr.reshape(-1)[0].float(), _f(weight_decay)
    for i in range(len(w)):
        p = w[i].float()
        sg = g[i].float() * inv / clip
        if mode == 0:
            sg = sg + decay * p
        mi = m[i].float() * b1 + b3 * sg
        vi = v[i].float() * b2 + (_f(1.0) - b2) * sg * sg
        u = (mi / bc1) / ((vi / bc2).sqrt() + _f(epsilon))
        if mode == 1:
            u = u + decay * p
        ratio = lr32
        pn, un = _norm(p), _norm(u)
        if (use_nvlamb or weight_decay != 0) and pn.item() != 0 and un.item() != 0:
            ratio = lr32 * (pn / un)
        new = p - ratio * u
        w[i].copy_(new)
        if model is not None:
            model[i].copy_(new)
        m[i].copy_(mi)
        v[i].copy_(vi)
