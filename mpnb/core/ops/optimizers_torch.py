"""PyTorch's fused optimizer ops behind mpnb's optimizer op signatures (CUDA tensors).

Devices without a kernel of ours (CUDA) take PyTorch's own fused optimizer ops
(``torch._fused_adamw_``, ``_fused_adam_``, ``_fused_sgd_``, ``_fused_adagrad_``) through the
``_torch_fused_*`` paths below, which keep the contract of :mod:`mpnb.core.ops.optimizers`:
half params are updated through fp32 weights (the masters, or fp32 copies) and cast back
in one ``_foreach_copy_``;
grads are unscaled into fp32 copies (``grad * inv_scale``, as the kernels do; PyTorch's own
``grad_scale`` would divide and write the grads back) and never written; ``found_inf`` is
read on the device (no host sync) and a flagged step changes nothing, step counts included.
Options PyTorch's ops lack (no bias correction, ``adagrad_w_mode``, ``wd_after_momentum``)
fall back to the references, which are PyTorch ops too.
"""

from __future__ import annotations

import torch

__all__: list[str] = []  # private paths, called by mpnb.core.ops.optimizers


def _fp32_weights(params, masters) -> list[torch.Tensor]:
    # The fp32 tensors PyTorch's op updates: the masters, fp32 params themselves, or copies.
    if masters:
        return list(masters)
    return [p if p.dtype == torch.float32 else p.float() for p in params]


def _fp32_grads(grads, inv_scale) -> list[torch.Tensor]:
    # Always copies: PyTorch's CUDA fused ops write their (unscaled, decayed) grads back.
    g32 = [g.to(torch.float32, copy=True) for g in grads]
    if inv_scale is not None:
        inv = inv_scale.to(device=g32[0].device, dtype=torch.float32).reshape(())
        torch._foreach_mul_(g32, inv)
    return g32


def _flag(found_inf, device) -> torch.Tensor | None:
    if found_inf is None:
        return None
    return found_inf.to(device=device, dtype=torch.float32).reshape(())


def _via_torch(params, grads, masters, steps, inv_scale, found_inf, call) -> bool:
    """Run ``call(weights, grads, found)`` (one PyTorch fused op) on fp32 weights and fp32
    unscaled grads, then undo a flagged step's count (PyTorch's own recipe: no host sync)
    and cast the weights back into half params."""
    if not params:
        return True
    w, found = _fp32_weights(params, masters), _flag(found_inf, params[0].device)
    if steps:
        torch._foreach_add_(list(steps), 1)
    call(w, _fp32_grads(grads, inv_scale), found)
    if found is not None and steps:
        torch._foreach_sub_(list(steps), [found] * len(steps))
    if params[0].dtype != torch.float32:
        torch._foreach_copy_(list(params), w)
    return True


def _torch_fused_adam_(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    masters,
    steps,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    adam_w_mode,
    bias_correction,
    inv_scale=None,
    found_inf=None,
) -> bool:
    """:func:`fused_adam_` through ``torch._fused_adamw_`` / ``_fused_adam_``; False when
    PyTorch's op cannot express the call (no bias correction)."""
    if not bias_correction:
        return False
    op = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    return _via_torch(
        params, grads, masters, steps, inv_scale, found_inf,
        lambda w, g, found: op(
            w, g, list(exp_avgs), list(exp_avg_sqs), [], list(steps), lr=lr, beta1=beta1,
            beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
            found_inf=found,
        ),
    )  # fmt: skip


def _torch_fused_adagrad_(
    params,
    grads,
    sums,
    masters,
    steps,
    lr,
    eps,
    weight_decay,
    lr_decay,
    adagrad_w_mode,
    inv_scale=None,
    found_inf=None,
) -> bool:
    """:func:`fused_adagrad_` through ``torch._fused_adagrad_``; False with adagrad_w_mode."""
    if adagrad_w_mode:
        return False
    return _via_torch(
        params, grads, masters, steps, inv_scale, found_inf,
        lambda w, g, found: torch._fused_adagrad_(
            w, g, list(sums), list(steps), lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
            eps=eps, maximize=False, found_inf=found,
        ),
    )  # fmt: skip


def _torch_fused_sgd_(
    params,
    grads,
    momentum_buffers,
    masters,
    first_run,
    lr,
    momentum,
    dampening,
    weight_decay,
    nesterov,
    wd_after_momentum,
    inv_scale=None,
    found_inf=None,
) -> bool:
    """:func:`fused_sgd_` through ``torch._fused_sgd_`` (one call per ``first_run`` value);
    False with wd_after_momentum."""
    if wd_after_momentum:
        return False
    groups = {False: list(range(len(params)))}
    if momentum != 0:
        groups = {f: [i for i, x in enumerate(first_run) if bool(x) == f] for f in (False, True)}

    def call(w, g, found):
        for first, idx in groups.items():
            if idx:
                bufs = [momentum_buffers[i] for i in idx] if momentum != 0 else []
                torch._fused_sgd_(
                    [w[i] for i in idx], [g[i] for i in idx], bufs, weight_decay=weight_decay,
                    momentum=momentum, lr=lr, dampening=dampening, nesterov=nesterov,
                    maximize=False, is_first_step=first, found_inf=found,
                )  # fmt: skip

    return _via_torch(params, grads, masters, [], inv_scale, found_inf, call)
