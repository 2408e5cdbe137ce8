"""Apex's ``amp_C`` extension module, with Apex's signatures, on mpnb's kernels.

Code that calls ``amp_C.multi_tensor_l2norm(chunk_size, noop_flag, [tensors], per_tensor)``
directly (Megatron does) runs unchanged against ``mpnb.amp_C``. ``chunk_size`` is accepted for
compatibility; the CPU kernels use their own cache-sized chunks, so results do not depend on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpnb.core.ops import multi_tensor as _mt

__all__ = [
    "multi_tensor_scale",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_unscale_l2norm",
    "multi_tensor_check_finite",
    "update_scale_hysteresis",
]

TensorLists = Sequence[Sequence[torch.Tensor]]


def _lists(op: str, tensor_lists: TensorLists, n: int) -> list[list[torch.Tensor]]:
    if len(tensor_lists) != n:
        raise ValueError(
            f"amp_C.{op}: expected {n} tensor list(s) in tensor_lists, got {len(tensor_lists)}; "
            f"pass [{', '.join(f'list{i}' for i in range(n))}]."
        )
    return [list(t) for t in tensor_lists]


def multi_tensor_scale(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, scale: float
) -> None:
    """``tensor_lists = [src, dst]``: ``dst = src * scale``, flag non-finite ``src`` values."""
    src, dst = _lists("multi_tensor_scale", tensor_lists, 2)
    _mt.multi_tensor_scale(noop_flag, src, dst, scale)


def multi_tensor_axpby(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: TensorLists,
    a: float,
    b: float,
    arg_to_check: int,
) -> None:
    """``tensor_lists = [x, y, out]``: ``out = a*x + b*y``; ``arg_to_check`` -1/0/1 as in Apex."""
    x, y, out = _lists("multi_tensor_axpby", tensor_lists, 3)
    _mt.multi_tensor_axpby(noop_flag, x, y, out, a, b, arg_to_check)


def multi_tensor_l2norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: TensorLists,
    per_tensor: bool | None = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor_lists = [tensors]``: ``(global_norm[1], per_tensor_norms[n or 0])``."""
    (x,) = _lists("multi_tensor_l2norm", tensor_lists, 1)
    return _mt.multi_tensor_l2norm(noop_flag, x, bool(per_tensor))


def multi_tensor_unscale_l2norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: TensorLists,
    inv_scale: torch.Tensor,
    per_tensor: bool | None = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Norms of ``tensors * inv_scale`` without modifying the tensors (grad clipping under amp)."""
    (x,) = _lists("multi_tensor_unscale_l2norm", tensor_lists, 1)
    if not isinstance(inv_scale, torch.Tensor):
        inv_scale = torch.tensor([float(inv_scale)], dtype=torch.float32)
    return _mt.multi_tensor_l2norm(noop_flag, x, bool(per_tensor), inv_scale)


def multi_tensor_check_finite(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists
) -> None:
    """``tensor_lists = [tensors]``: read-only inf/NaN check (an mpnb addition to amp_C)."""
    (x,) = _lists("multi_tensor_check_finite", tensor_lists, 1)
    _mt.multi_tensor_check_finite(noop_flag, x)


def update_scale_hysteresis(
    current_scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
) -> torch.Tensor:
    """Apex's loss-scale update with hysteresis, in place; returns ``current_scale``."""
    return _mt.update_scale_hysteresis(
        current_scale,
        growth_tracker,
        hysteresis_tracker,
        found_inf,
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
    )


# ---- optimizer kernels (Apex's multi_tensor_{adam,sgd,lamb,novograd,adagrad}) --------------
# Apex passes the step count as a number; our kernels keep it in per-param tensors and
# advance it themselves, so a temporary step tensor holding ``step - 1`` is handed over.
# ``noop_flag`` is honoured as Apex does: when it is set the kernel writes nothing.


def _steps(n: int, step: int) -> list[torch.Tensor]:
    return [torch.tensor(float(step) - 1.0) for _ in range(n)]


def multi_tensor_adam(
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
) -> None:
    """``[grads, params, exp_avgs, exp_avg_sqs]``; ``mode`` 0 = Adam (L2), 1 = AdamW."""
    from mpnb.core.ops.optimizers import fused_adam_

    g, p, m, v = _lists("multi_tensor_adam", tensor_lists, 4)
    fused_adam_(
        p,
        g,
        m,
        v,
        [],
        _steps(len(p), step),
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=epsilon,
        weight_decay=weight_decay,
        adam_w_mode=mode == 1,
        bias_correction=bool(bias_correction),
        found_inf=noop_flag,
    )


def multi_tensor_sgd(
    chunk_size,
    noop_flag,
    tensor_lists,
    wd,
    momentum,
    dampening,
    lr,
    nesterov,
    first_run,
    wd_after_momentum,
    scale,
) -> None:
    """``[grads, params, momentum_buffers]`` or, with fp16 model copies, ``[..., model_params]``."""
    from mpnb.core.ops.optimizers import fused_sgd_

    if len(tensor_lists) == 4:
        g, master, buf, model = (list(t) for t in tensor_lists)
        params, masters = model, master
    else:
        g, params, buf = _lists("multi_tensor_sgd", tensor_lists, 3)
        masters = []
    inv = torch.tensor([float(scale)], dtype=torch.float32)
    fused_sgd_(
        params,
        g,
        buf,
        masters,
        [bool(first_run)] * len(params),
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=wd,
        nesterov=bool(nesterov),
        wd_after_momentum=bool(wd_after_momentum),
        inv_scale=inv,
        found_inf=noop_flag,
    )


def multi_tensor_lamb(
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
    use_nvlamb=False,
) -> None:
    """``[grads, params, exp_avgs, exp_avg_sqs]``; ``mode`` 0 = L2 decay, 1 = decoupled."""
    from mpnb.core.ops.optimizers_lamb import fused_lamb_

    g, p, m, v = _lists("multi_tensor_lamb", tensor_lists, 4)
    fused_lamb_(
        p,
        g,
        m,
        v,
        [],
        _steps(len(p), step),
        global_grad_norm,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=epsilon,
        weight_decay=weight_decay,
        adam_w_mode=mode == 1,
        bias_correction=bool(bias_correction),
        grad_averaging=bool(grad_averaging),
        max_grad_norm=max_grad_norm,
        use_nvlamb=bool(use_nvlamb),
        found_inf=noop_flag,
    )


def multi_tensor_novograd(
    chunk_size,
    noop_flag,
    tensor_lists,
    grad_norms,
    lr,
    beta1,
    beta2,
    epsilon,
    step,
    bias_correction,
    weight_decay,
    grad_averaging,
    mode,
    norm_type,
) -> None:
    """``[grads, params, exp_avgs]``; ``grad_norms`` holds the per-tensor second moments and
    is blended with this step's grad norms in place (Apex); ``mode`` 0 = reg inside moment."""
    from mpnb.core.ops.optimizers_lamb import fused_novograd_

    g, p, m = _lists("multi_tensor_novograd", tensor_lists, 3)
    if norm_type == 2:
        norms = multi_tensor_l2norm(chunk_size, torch.zeros(1), [g], True)[1].float()
    else:
        norms = torch.stack([x.abs().max().float() for x in g])
    fused_novograd_(
        p,
        g,
        m,
        list(grad_norms.unbind()),
        [],
        _steps(len(p), step),
        norms.contiguous(),
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=epsilon,
        weight_decay=weight_decay,
        bias_correction=bool(bias_correction),
        grad_averaging=bool(grad_averaging),
        reg_inside_moment=mode == 0,
        norm_type=int(norm_type),
        init_zero=True,
        found_inf=noop_flag,
    )


def multi_tensor_adagrad(
    chunk_size, noop_flag, tensor_lists, lr, epsilon, mode, weight_decay
) -> None:
    """``[grads, params, sums]``; ``mode`` 0 = L2 decay, 1 = decoupled (adagrad_w_mode)."""
    from mpnb.core.ops.optimizers import fused_adagrad_

    g, p, h = _lists("multi_tensor_adagrad", tensor_lists, 3)
    fused_adagrad_(
        p,
        g,
        h,
        [],
        _steps(len(p), 1),
        lr=lr,
        eps=epsilon,
        weight_decay=weight_decay,
        adagrad_w_mode=mode == 1,
        found_inf=noop_flag,
    )


__all__ += [
    "multi_tensor_adam",
    "multi_tensor_sgd",
    "multi_tensor_lamb",
    "multi_tensor_novograd",
    "multi_tensor_adagrad",
]
