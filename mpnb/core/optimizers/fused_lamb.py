"""FusedLAMB: Apex's fused LAMB (layer-wise adaptive moments), as C++ multi-tensor kernels."""

from __future__ import annotations

import math
from functools import partial

import torch

from mpnb.core import amp_C
from mpnb.core.ops.l2norm import multi_tensor_l2norm
from mpnb.core.ops.lamb import fused_lamb_, fused_lamb_bf16_
from mpnb.core.optimizers._base import FusedOptimizerBase, check_hyperparams

__all__ = ["FusedLAMB"]


class FusedLAMB(FusedOptimizerBase):
    r"""LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning"), fused.

    .. math::
        g_t &= \nabla_\theta
            / \max(1, \lVert\nabla\rVert_{\text{global}} / \text{max\_grad\_norm}) \\
        m_t &= \beta_1 m_{t-1} + \beta_3 g_t, \qquad v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2 \\
        u_t &= \frac{m_t/(1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t)} + \epsilon}
            + \lambda\theta_{t-1} \\
        \theta_t &= \theta_{t-1} - \eta\,\frac{\lVert\theta_{t-1}\rVert}{\lVert u_t\rVert}\,u_t

    per tensor; :math:`\beta_3 = 1-\beta_1` with ``grad_averaging`` (else 1); without
    ``adam_w_mode`` the decay enters :math:`g_t` instead of :math:`u_t`; the trust ratio is 1
    when either norm is 0, and also when ``weight_decay == 0`` unless ``use_nvlamb``.

    Args:
        lr (1e-3), bias_correction (True), betas ((0.9, 0.999)), eps (1e-6),
        weight_decay (0.01), adam_w_mode (True), grad_averaging (True), set_grad_none (True),
        max_grad_norm (1.0; <= 0 disables the global clipping), use_nvlamb (False): Apex's.
        amsgrad: not supported (raises).
        master_weights: keep fp32 master copies of fp16/bf16 params (mpnb extension).
        stochastic_rounding, kahan_summation, generator: pure bf16 training, as in
            :class:`~mpnb.core.optimizers.FusedAdam` (exclusive with each other and with
            master weights).

    Example::

        >>> opt = FusedLAMB(model.parameters(), lr=1e-3, weight_decay=0.01)
    """

    _state_keys = ("exp_avg", "exp_avg_sq")
    _check_grads = False  # the global grad-norm pass flags inf/NaN before any write
    multi_tensor_lamb = staticmethod(amp_C.multi_tensor_lamb)  # Apex's attributes
    multi_tensor_l2norm = staticmethod(amp_C.multi_tensor_l2norm)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        master_weights: bool = False,
        stochastic_rounding: bool = False,
        kahan_summation: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant; drop amsgrad=True.")
        check_hyperparams("FusedLAMB", lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
        if not math.isfinite(float(max_grad_norm)):
            raise ValueError(
                f"FusedLAMB: Invalid max_grad_norm: {max_grad_norm!r} (must be finite; <= 0 "
                "turns the global clipping off)."
            )
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
        )
        super().__init__(
            params,
            defaults,
            master_weights=master_weights,
            set_grad_none=set_grad_none,
            stochastic_rounding=stochastic_rounding,
            kahan_summation=kahan_summation,
            generator=generator,
        )
        self.adam_w_mode = bool(adam_w_mode)
        self.use_nvlamb = bool(use_nvlamb)
        self._global_norm: torch.Tensor | None = None

    def _prepare(self, work, inv_scale, found_inf) -> None:
        # One global norm over every group and dtype bucket (Apex clips by the global norm).
        # On the grads' device: no host sync per bucket, and a CUDA step's flag on CUDA.
        dev = next((b.grads[0].device for _, bs in work for b in bs if b.grads), None)
        flag = found_inf if found_inf is not None else torch.zeros(1, device=dev)
        norms = [
            multi_tensor_l2norm(flag, b.grads, False, inv_scale)[0].to(dev).reshape(())
            for _, buckets in work
            for b in buckets
        ]
        if len(norms) == 1 and norms[0].dtype == torch.float32:
            # The fp64 sum of one square is the square itself, and its root the fp32 norm
            # exactly (an fp32's square is exact in fp64): the same bits, five ops fewer.
            self._global_norm = norms[0].reshape(1)
            return
        total = torch.zeros((), dtype=torch.float64, device=dev)
        for norm in norms:
            total = total + norm.double().square()
        self._global_norm = total.sqrt().float().reshape(1)

    def _update(self, group, bucket, inv_scale, found_inf) -> None:
        beta1, beta2 = group["betas"]
        rounded = self.rounding_args(group, bucket)
        if rounded is None:
            op, fifth = fused_lamb_, bucket.masters
        else:
            fifth = rounded.pop("compensations")
            op = partial(fused_lamb_bf16_, **rounded)
        op(
            bucket.params,
            bucket.grads,
            self.state_list(bucket, "exp_avg"),
            self.state_list(bucket, "exp_avg_sq"),
            fifth,
            self.state_list(bucket, "step"),
            self._global_norm,
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            **self.group_args(group, "fused_lamb_"),
            adam_w_mode=self.adam_w_mode,
            use_nvlamb=self.use_nvlamb,
            inv_scale=inv_scale,
            found_inf=found_inf,
        )
