"""The rest of Apex's ``amp_C``: the capturable Adam, the mixed-precision LAMB, the two LAMB stages
and the norm variants, with Apex's signatures, on mpnb's ops (re-exported by
:mod:`mpnb.core.amp_C`).

Each computes what Apex's kernel computes (its semantics, not its code), through mpnb's ops
(:func:`~mpnb.core.ops.fused_adam_`, :func:`~mpnb.core.ops.fused_lamb_`,
:func:`~mpnb.core.ops.multi_tensor_l2norm`, :func:`~mpnb.core.ops.multi_tensor_scale`) or, for
the LAMB stages that no op of ours has, torch's ``_foreach`` ops in fp32 with the rounding
Apex's kernel does. :mod:`mpnb.core.amp_C_reference` holds one plain per-tensor reference of
each, which the tests hold these to.

Tensor arguments Apex reads on the device (``lr``, ``step``, ``inv_scale`` of the capturable
and mixed-precision forms) are read once on the host here: CUDA graphs capture PyTorch's own
capturable optimizers, not these.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpnb.core import ops as _mt

__all__ = [
    "multi_tensor_l2norm_mp",
    "multi_tensor_l2norm_scale",
    "multi_tensor_lamb_stage1_cuda",
    "multi_tensor_lamb_stage2_cuda",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_lamb_mp",
]

TensorLists = Sequence[Sequence[torch.Tensor]]
_F32 = torch.float32


def _lists(op: str, tensor_lists: TensorLists, *counts: int) -> list[list[torch.Tensor]]:
    if len(tensor_lists) not in counts:
        want = " or ".join(str(c) for c in counts)
        raise ValueError(
            f"amp_C.{op}: expected {want} tensor lists in tensor_lists, got {len(tensor_lists)}; "
            "see Apex's kernel for their order."
        )
    return [list(t) for t in tensor_lists]


def _set(flag: torch.Tensor) -> bool:
    return bool(flag.reshape(-1)[0].item() != 0)


def _steps(n: int, step: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
    # our ops advance per-param fp32 step tensors themselves: hand over ``step - 1``
    dev = like[0].device if like else torch.device("cpu")
    dev = torch.device("cpu") if dev.type == "cpu" else dev
    return [torch.full((), float(step) - 1.0, device=dev) for _ in range(n)]


def _value(x) -> float:
    return float(x.reshape(-1)[0].item()) if isinstance(x, torch.Tensor) else float(x)


def _f32(x: float) -> float:
    """``x`` rounded to fp32, as the kernel holds its float arguments."""
    return float(torch.tensor(x, dtype=_F32))


def _rounded(xs: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """fp32 values rounded to ``dtype`` and widened back (nothing to do for fp32)."""
    return xs if dtype == _F32 else [x.to(dtype).float() for x in xs]


def multi_tensor_l2norm_mp(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, per_tensor=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`mpnb.amp_C.multi_tensor_l2norm`, but a set ``noop_flag`` on entry skips the
    work (the step is skipped anyway): the norms are then zeros (Apex leaves them unset)."""
    (x,) = _lists("multi_tensor_l2norm_mp", tensor_lists, 1)
    if _set(noop_flag):
        dev = x[0].device if x else noop_flag.device
        n = len(x) if per_tensor else 0
        return torch.zeros(1, device=dev), torch.zeros(n, device=dev)
    return _mt.multi_tensor_l2norm(noop_flag, x, bool(per_tensor))


def multi_tensor_l2norm_scale(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: TensorLists,
    scale: float,
    per_tensor=False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor_lists = [src, dst]``: the L2 norms of ``src`` (not scaled) and
    ``dst = src * scale``; a non-finite ``src`` sets ``noop_flag``."""
    src, dst = _lists("multi_tensor_l2norm_scale", tensor_lists, 2)
    norms = _mt.multi_tensor_l2norm(noop_flag, src, bool(per_tensor))
    _mt.multi_tensor_scale(noop_flag, src, dst, float(scale))
    return norms


def multi_tensor_lamb_stage1_cuda(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: TensorLists,
    per_tensor_decay: torch.Tensor,
    step: int,
    beta1: float,
    beta2: float,
    epsilon: float,
    global_grad_norm: torch.Tensor,
    max_global_grad_norm: float,
) -> None:
    """LAMB's first stage (NVIDIA's BERT): ``tensor_lists = [g, p, m, v, update]``.

    With ``c = max(1, |G| / max_global_grad_norm)``, ``t = step + 1`` and the decay ``d`` of
    each tensor: ``m = b1 m + (1-b1) g/c``, ``v = b2 v + (1-b2) (g/c)^2``,
    ``update = (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps) + d p``. Computed in fp32 and, as
    Apex's kernel, rounded to the params' dtype at each of those assignments; ``m``, ``v``
    in place, ``update`` written in its own dtype. ``noop_flag`` is not read (Apex's kernel
    lets inf/NaN through).
    """
    g, p, m, v, upd = _lists("multi_tensor_lamb_stage1_cuda", tensor_lists, 5)
    if not p:
        return
    dt = p[0].dtype
    gnorm = _value(global_grad_norm)
    clip = _f32(gnorm / max_global_grad_norm) if gnorm > max_global_grad_norm else 1.0
    b1, b2, t = _f32(beta1), _f32(beta2), step + 1
    bc1, bc2 = _f32(1.0 - _f32(b1**t)), _f32(1.0 - _f32(b2**t))
    sg = _rounded(torch._foreach_div([x.float() for x in g], clip), dt)
    m32 = torch._foreach_add(
        torch._foreach_mul([x.float() for x in m], b1), torch._foreach_mul(sg, _f32(1 - b1))
    )
    m32 = _rounded(m32, dt)
    sq = torch._foreach_mul(torch._foreach_mul(sg, _f32(1 - b2)), sg)
    v32 = _rounded(torch._foreach_add(torch._foreach_mul([x.float() for x in v], b2), sq), dt)
    mh = _rounded(torch._foreach_div(m32, bc1), dt)
    denom = _rounded(
        torch._foreach_add(
            torch._foreach_sqrt(_rounded(torch._foreach_div(v32, bc2), dt)), _f32(epsilon)
        ),
        dt,
    )
    decay = per_tensor_decay.to(_F32).reshape(-1).tolist()
    decayed = torch._foreach_mul([x.float() for x in p], decay)
    direction = _rounded(torch._foreach_add(torch._foreach_div(mh, denom), decayed), dt)
    torch._foreach_copy_(m, m32)
    torch._foreach_copy_(v, v32)
    torch._foreach_copy_(upd, direction)


def multi_tensor_lamb_stage2_cuda(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: TensorLists,
    per_tensor_param_norm: torch.Tensor,
    per_tensor_update_norm: torch.Tensor,
    lr: float,
    weight_decay: float,
    use_nvlamb=False,
) -> None:
    """LAMB's second stage: ``tensor_lists = [p, update]``, ``p -= r * update`` with the trust
    ratio ``r = lr * |p| / |update|`` (``lr`` when a norm is 0, or without decay unless
    ``use_nvlamb``), from the per-tensor norms given; fp32 math, ``p`` rounded to its dtype.
    ``noop_flag`` is not read (as Apex's kernel)."""
    p, upd = _lists("multi_tensor_lamb_stage2_cuda", tensor_lists, 2)
    if not p:
        return
    lr32 = torch.tensor(_f32(lr), dtype=_F32)
    pn = per_tensor_param_norm.to("cpu", _F32).reshape(-1)
    un = per_tensor_update_norm.to("cpu", _F32).reshape(-1)
    adaptive = bool(use_nvlamb) or weight_decay != 0.0
    ratios = []
    for i in range(len(p)):
        trust = adaptive and pn[i].item() != 0.0 and un[i].item() != 0.0
        ratios.append(float(lr32 * (pn[i] / un[i])) if trust else float(lr32))
    new = torch._foreach_sub(
        [x.float() for x in p], torch._foreach_mul([u.float() for u in upd], ratios)
    )
    torch._foreach_copy_(p, new)


def _adam_capturable(
    op,
    tensor_lists,
    n_lists,
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
) -> None:
    from mpnb.core.amp_C import _check_step, _fp32, _write_back

    lists = _lists(op, tensor_lists, n_lists)
    _check_step(op, step, bias_correction)
    g, p, m, v = lists[:4]
    if not p or _set(noop_flag):
        return
    masters = lists[4] if n_lists == 5 else []
    back: list = []
    inv = inv_scale.reshape(1).to(_F32)
    _mt.fused_adam_(
        p,
        g,
        _fp32(m, back),
        _fp32(v, back),
        masters,
        _steps(len(p), int(_value(step)), p),
        lr=_value(lr),
        beta1=beta1,
        beta2=beta2,
        eps=epsilon,
        weight_decay=weight_decay,
        adam_w_mode=mode == 1,
        bias_correction=bool(bias_correction),
        inv_scale=inv,
    )
    _write_back(back)
    if not masters and p[0].dtype != _F32:  # Apex stores these moments rounded to p's dtype
        for x in (*m, *v):
            x.copy_(x.to(p[0].dtype))
    torch._foreach_mul_(g, inv.reshape(()).to(g[0].device))  # Apex leaves them unscaled


def multi_tensor_adam_capturable(
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
    """``[grads, params, exp_avgs, exp_avg_sqs]``: Adam (``mode`` 0, L2) or AdamW (1) with
    ``lr``, ``step`` (the count after this step) and ``inv_scale`` as tensors; the grads are
    unscaled (``g *= inv_scale``, as Apex's kernel leaves them); a set ``noop_flag`` writes
    nothing. Half params keep fp32 moments rounded to their dtype (as Apex's kernel)."""
    _adam_capturable(
        "multi_tensor_adam_capturable",
        tensor_lists,
        4,
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


def multi_tensor_adam_capturable_master(
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
    """As :func:`multi_tensor_adam_capturable` with a fifth list, the fp32 master weights:
    the masters are updated and the (half) params receive their rounded copy."""
    _adam_capturable(
        "multi_tensor_adam_capturable_master",
        tensor_lists,
        5,
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


def multi_tensor_lamb_mp(
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
    """Apex's FusedMixedPrecisionLamb step: ``[g, p, m, v]`` (params updated directly, moments
    in their dtype) or ``[g, p_master, m, v, p_model]`` (fp32 masters updated, the model's
    half params get their rounded copy). ``lr``, ``step`` (the count after this step),
    ``global_grad_norm`` and ``max_grad_norm`` (both of the *scaled* grads), ``found_inf`` and
    ``inv_scale`` are tensors; ``mode`` 0 = L2 decay, 1 = decoupled. A set ``noop_flag`` or
    ``found_inf`` writes nothing. The grads are left as they are (Apex's kernel writes the
    update into them)."""
    from mpnb.core.amp_C import _check_step, _fp32, _write_back

    lists = _lists("multi_tensor_lamb_mp", tensor_lists, 4, 5)
    _check_step("multi_tensor_lamb_mp", step, bias_correction)
    g, w, m, v = lists[:4]
    if not w or _set(noop_flag) or _set(found_inf):
        return
    params, masters = (lists[4], w) if len(lists) == 5 else (w, [])
    back: list = []
    _mt.fused_lamb_(
        params,
        g,
        _fp32(m, back),
        _fp32(v, back),
        masters,
        _steps(len(params), int(_value(step)), params),
        global_grad_norm.reshape(1).to(_F32),
        lr=_value(lr),
        beta1=beta1,
        beta2=beta2,
        eps=epsilon,
        weight_decay=weight_decay,
        adam_w_mode=mode == 1,
        bias_correction=bool(bias_correction),
        grad_averaging=bool(grad_averaging),
        max_grad_norm=_value(max_grad_norm),
        use_nvlamb=bool(use_nvlamb),
        inv_scale=inv_scale.reshape(1).to(_F32),
    )
    _write_back(back)
