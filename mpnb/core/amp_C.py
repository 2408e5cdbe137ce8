"""Apex's ``amp_C`` extension module, with Apex's signatures, on mpnb's kernels.

Code that calls ``amp_C.multi_tensor_l2norm(chunk_size, noop_flag, [tensors], per_tensor)``
directly (Megatron does) runs unchanged against ``mpnb.amp_C``. ``chunk_size`` is accepted for
compatibility; the CPU kernels use their own cache-sized chunks, so results do not depend on it.

All 17 of Apex's functions are here (and ``multi_tensor_check_finite``, an mpnb addition): the
capturable Adam, the mixed-precision LAMB, the two LAMB stages and the norm variants live in
:mod:`mpnb.core._amp_C_mp`; their plain references in :mod:`mpnb.core.amp_C_reference`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpnb.core import ops as _mt

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
    """Apex's loss-scale update with hysteresis, in place; returns ``current_scale``.

    Apex's kernel's rule (:func:`mpnb.core.ops.reference_update_scale_hysteresis`), its
    flush of a subnormal new scale to 0 included.
    """
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
# Apex passes the step count as a number; our ops keep it in per-param tensors and advance it
# themselves, so a temporary step tensor holding ``step - 1`` is handed over. ``noop_flag`` is
# honoured: when it is set on entry nothing is written. Apex keeps the state of half params
# without masters in the param dtype; our ops keep fp32 state, so such state goes through an
# fp32 copy that is written back (the same rounding as Apex's kernels: fp32 math, one store).


def _check_step(op: str, step, bias_correction) -> None:
    """Refuse ``step < 1`` with bias correction, before anything is written.

    The bias correction ``1 - beta**step`` is 0 at step 0 (negative below it), so the update
    would divide by zero and every param become NaN or inf; Apex's kernel does exactly that,
    silently. Apex's optimizers count steps from 1 (they add 1 before the call); a caller that
    passes 0 has forgotten to. Refused rather than warned: a warning would still leave every
    weight NaN. A tensor ``step`` (the capturable forms) is read once on the host here.
    """
    if not bias_correction:
        return
    n = float(step.reshape(-1)[0]) if isinstance(step, torch.Tensor) else float(step)
    if n < 1:
        raise ValueError(
            f"amp_C.{op}: step={n:g} with bias_correction=1: the bias correction "
            "1 - beta**step is 0 at step 0 (negative below), so every param would become "
            "NaN/inf. Count steps from 1, as Apex's optimizers do (step += 1 before the call), "
            "or pass bias_correction=0. Nothing was written."
        )


def _steps(n: int, step: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
    dev = like[0].device if like else torch.device("cpu")
    dev = torch.device("cpu") if dev.type == "cpu" else dev
    return [torch.full((), float(step) - 1.0, device=dev) for _ in range(n)]


def _fp32(lst: list[torch.Tensor], back: list) -> list[torch.Tensor]:
    if not lst or lst[0].dtype == torch.float32:
        return lst
    f = [t.float() for t in lst]
    back.append((lst, f))
    return f


def _write_back(back: list) -> None:
    for lst, f in back:
        torch._foreach_copy_(lst, f)


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
    """``[grads, params, exp_avgs, exp_avg_sqs]``; ``mode`` 0 = Adam (L2), 1 = AdamW.

    ``step`` is the count after this step (1 at the first); with ``bias_correction`` a step
    below 1 is refused (:func:`_check_step`), where Apex's kernel writes NaN."""
    from mpnb.core.ops.adam import fused_adam_

    g, p, m, v = _lists("multi_tensor_adam", tensor_lists, 4)
    _check_step("multi_tensor_adam", step, bias_correction)
    back: list = []
    fused_adam_(
        p,
        g,
        _fp32(m, back),
        _fp32(v, back),
        [],
        _steps(len(p), step, p),
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=epsilon,
        weight_decay=weight_decay,
        adam_w_mode=mode == 1,
        bias_correction=bool(bias_correction),
        found_inf=noop_flag,
    )
    _write_back(back)


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
    """``[grads, params, momentum_buffers]`` or, with fp16 model copies, ``[..., model_params]``
    (then ``params`` are the fp32 masters); grads are multiplied by ``scale`` first."""
    from mpnb.core.ops.sgd import fused_sgd_

    if len(tensor_lists) == 4:
        g, masters, buf, params = (list(t) for t in tensor_lists)
    else:
        g, params, buf = _lists("multi_tensor_sgd", tensor_lists, 3)
        masters = []
    back: list = []
    inv = torch.tensor([float(scale)], dtype=torch.float32)
    fused_sgd_(
        params,
        g,
        _fp32(buf, back),
        masters,
        [bool(first_run)] * len(params),
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=wd,
        nesterov=bool(nesterov),
        wd_after_momentum=bool(wd_after_momentum),
        inv_scale=None if float(scale) == 1.0 else inv,
        found_inf=noop_flag,
    )
    _write_back(back)


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
    from mpnb.core.ops.lamb import fused_lamb_

    g, p, m, v = _lists("multi_tensor_lamb", tensor_lists, 4)
    _check_step("multi_tensor_lamb", step, bias_correction)
    back: list = []
    fused_lamb_(
        p,
        g,
        _fp32(m, back),
        _fp32(v, back),
        [],
        _steps(len(p), step, p),
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
    _write_back(back)


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
    from mpnb.core.ops.novograd import fused_novograd_

    g, p, m = _lists("multi_tensor_novograd", tensor_lists, 3)
    _check_step("multi_tensor_novograd", step, bias_correction)
    if norm_type == 2:
        flag = torch.zeros(1, device=grad_norms.device)
        norms = multi_tensor_l2norm(chunk_size, flag, [g], True)[1].float()
    else:
        norms = torch.stack([x.abs().max().float() for x in g])
    back: list = []
    fused_novograd_(
        p,
        g,
        _fp32(m, back),
        list(grad_norms.unbind()),
        [],
        _steps(len(p), step, p),
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
    _write_back(back)


def multi_tensor_adagrad(
    chunk_size, noop_flag, tensor_lists, lr, epsilon, mode, weight_decay
) -> None:
    """``[grads, params, sums]``; ``mode`` 0 = L2 decay, 1 = decoupled (adagrad_w_mode)."""
    from mpnb.core.ops.adagrad import fused_adagrad_

    g, p, h = _lists("multi_tensor_adagrad", tensor_lists, 3)
    back: list = []
    fused_adagrad_(
        p,
        g,
        _fp32(h, back),
        [],
        _steps(len(p), 1, p),
        lr=lr,
        eps=epsilon,
        weight_decay=weight_decay,
        adagrad_w_mode=mode == 1,
        found_inf=noop_flag,
    )
    _write_back(back)


__all__ += [
    "multi_tensor_adam",
    "multi_tensor_sgd",
    "multi_tensor_lamb",
    "multi_tensor_novograd",
    "multi_tensor_adagrad",
]

from mpnb.core._amp_C_mp import (  # noqa: E402 - they use this module's helpers
    multi_tensor_adam_capturable,
    multi_tensor_adam_capturable_master,
    multi_tensor_l2norm_mp,
    multi_tensor_l2norm_scale,
    multi_tensor_lamb_mp,
    multi_tensor_lamb_stage1_cuda,
    multi_tensor_lamb_stage2_cuda,
)

__all__ += [
    "multi_tensor_l2norm_mp",
    "multi_tensor_l2norm_scale",
    "multi_tensor_lamb_stage1_cuda",
    "multi_tensor_lamb_stage2_cuda",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_lamb_mp",
]
