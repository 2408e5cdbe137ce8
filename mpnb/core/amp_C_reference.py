"""Plain references of the ``amp_C`` functions that no single mpnb op holds to account (the
capturable Adam, the mixed-precision LAMB, the two LAMB stages and the norm variants), written
from what Apex's kernels compute: one tensor at a time, fp32 scalars and math, the roundings
those kernels do (a value assigned to a variable of the params' dtype is rounded to it), and
norms summed in fp64. The tests hold :mod:`mpnb.amp_C` to these on every dtype.

Each is derived from its row of :mod:`mpnb.core._amp_C_table` (Apex's signature, with
``reference_`` in front of the name), as the shims are.
"""

from __future__ import annotations

import math

import torch

from mpnb.core._amp_C_table import apex_shim

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


def _one(x: torch.Tensor) -> torch.Tensor:
    """The fp32 value of a one-element tensor argument."""
    return x.reshape(-1)[0].float()


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x.double().square().sum().sqrt().float()


def _norms(a, xs) -> tuple[torch.Tensor, torch.Tensor]:
    per = [_norm(x) for x in xs]
    total = torch.stack(per).double().square().sum().sqrt().float() if per else _f(0.0)
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
    """Apex's ``multi_tensor_lamb_stage1_cuda``: ``[g, p, m, v, update]``."""
    g, p, m, v, upd = a.g, a.p, a.m, a.v, a.upd
    gn, most = float(a.global_grad_norm.reshape(-1)[0]), a.max_global_grad_norm
    clip = _f(gn) / _f(most) if gn > most else _f(1.0)
    b1, b2 = _f(a.beta1), _f(a.beta2)
    bc1, bc2 = _f(1.0) - b1 ** float(a.step + 1), _f(1.0) - b2 ** float(a.step + 1)
    for i in range(len(p)):
        dt = p[i].dtype
        decay = a.per_tensor_decay.reshape(-1)[i].to(_F32)
        sg = _r(g[i].float() / clip, dt)
        mi = _r(m[i].float() * b1 + (_f(1.0) - b1) * sg, dt)
        vi = _r(v[i].float() * b2 + (_f(1.0) - b2) * sg * sg, dt)
        denom = _r(_r(vi / bc2, dt).sqrt() + _f(a.epsilon), dt)
        u = _r(_r(mi / bc1, dt) / denom + decay * p[i].float(), dt)
        m[i].copy_(mi)
        v[i].copy_(vi)
        upd[i].copy_(u)


def _ratio(a, lr, pn, un) -> torch.Tensor:
    """LAMB's trust ratio: ``lr * |p| / |u|``, or ``lr`` (a norm 0, or no decay nor NVLAMB)."""
    if (a.use_nvlamb or a.weight_decay != 0) and pn.item() != 0 and un.item() != 0:
        return lr * (pn.float() / un.float())
    return lr


@apex_shim
def reference_multi_tensor_lamb_stage2_cuda(a):
    """Apex's ``multi_tensor_lamb_stage2_cuda``: ``[p, update]``."""
    pn, un = a.per_tensor_param_norm.reshape(-1), a.per_tensor_update_norm.reshape(-1)
    for i, (p, u) in enumerate(zip(a.p, a.upd, strict=True)):
        p.copy_(p.float() - _ratio(a, _f(a.lr), pn[i], un[i]) * u.float())


def _capturable(a):
    """Apex's ``multi_tensor_adam_capturable`` (``[g, p, m, v]``) and, with a fifth list of
    fp32 masters, ``multi_tensor_adam_capturable_master``."""
    g, p, m, v, masters = a.grads, a.params, a.exp_avgs, a.exp_avg_sqs, getattr(a, "masters", None)
    if a.noop_flag.item() != 0:
        return
    lr, inv = _one(a.lr), _one(a.inv_scale)
    b1, b2, t, decay = _f(a.beta1), _f(a.beta2), float(int(a.step)), _f(a.weight_decay)
    bc1 = _f(1.0) - b1**t if a.bias_correction else _f(1.0)
    bc2 = _f(1.0) - b2**t if a.bias_correction else _f(1.0)
    for i in range(len(p)):
        w = masters[i].float() if masters is not None else p[i].float()
        unscaled = g[i].float() * inv  # what the kernel writes back into the grad
        gs = unscaled + decay * w if a.mode == 0 else unscaled
        mi = b1 * m[i].float() + (_f(1.0) - b1) * gs
        vi = b2 * v[i].float() + (_f(1.0) - b2) * gs * gs
        update = (mi / bc1) / ((vi / bc2).sqrt() + _f(a.epsilon))
        w = w - lr * (update + decay * w if a.mode == 1 else update)
        if masters is None:  # Apex's kernel stores these moments rounded to the params' dtype
            mi, vi = _r(mi, p[i].dtype), _r(vi, p[i].dtype)
        else:
            masters[i].copy_(w)
        for dst, src in ((p, w), (m, mi), (v, vi), (g, unscaled)):
            dst[i].copy_(src)


reference_multi_tensor_adam_capturable = apex_shim(
    _capturable, "reference_multi_tensor_adam_capturable"
)
reference_multi_tensor_adam_capturable_master = apex_shim(
    _capturable, "reference_multi_tensor_adam_capturable_master"
)


@apex_shim
def reference_multi_tensor_lamb_mp(a):
    """Apex's ``multi_tensor_lamb_mp``: ``[g, p, m, v]`` or ``[g, p_master, m, v, p_model]``
    (the update is not written into the grads here)."""
    g, w, m, v, model = a.grads, a.w, a.exp_avgs, a.exp_avg_sqs, a.model
    if a.noop_flag.item() != 0 or a.found_inf.item() != 0:
        return
    b1, b2 = _f(a.beta1), _f(a.beta2)
    b3 = _f(1.0) - b1 if a.grad_averaging else _f(1.0)
    t = float(_one(a.step))
    bc1 = _f(1.0) - b1**t if a.bias_correction else _f(1.0)
    bc2 = _f(1.0) - b2**t if a.bias_correction else _f(1.0)
    gn, mx = _one(a.global_grad_norm), _one(a.max_grad_norm)
    clip = gn / mx if gn.item() > mx.item() else _f(1.0)
    inv, lr, decay = _one(a.inv_scale), _one(a.lr), _f(a.weight_decay)
    for i in range(len(w)):
        p = w[i].float()
        sg = g[i].float() * inv / clip
        sg = sg + decay * p if a.mode == 0 else sg
        mi = m[i].float() * b1 + b3 * sg
        vi = v[i].float() * b2 + (_f(1.0) - b2) * sg * sg
        u = (mi / bc1) / ((vi / bc2).sqrt() + _f(a.epsilon))
        u = u + decay * p if a.mode == 1 else u
        new = p - _ratio(a, lr, _norm(p), _norm(u)) * u
        for dst, src in ((w, new), (model, new), (m, mi), (v, vi)):
            if dst is not None:
                dst[i].copy_(src)
