"""FusedNovoGrad: Apex's fused NovoGrad (layer-wise second moments), as C++ kernels."""

from __future__ import annotations

import torch

from mpnb.core import amp_C
from mpnb.core.ops.check_finite import multi_tensor_check_finite
from mpnb.core.ops.l2norm import multi_tensor_l2norm
from mpnb.core.ops.novograd import fused_novograd_
from mpnb.core.optimizers._base import FusedOptimizerBase, check_hyperparams

__all__ = ["FusedNovoGrad"]


class FusedNovoGrad(FusedOptimizerBase):
    r"""NovoGrad (Ginsburg et al., 2019), fused; the second moment is one scalar per tensor.

    .. math::
        n_t &= \lVert g_t\rVert_2 \;(\text{norm\_type}=2) \text{ or } \max|g_t| \;(0) \\
        v_t &= \sqrt{\beta_2 v_{t-1}^2 + (1-\beta_2) n_t^2}
            \text{ or } \beta_2 v_{t-1} + (1-\beta_2) n_t \\
        d_t &= v_t/\sqrt{1-\beta_2^t} + \epsilon, \qquad m_t = \beta_1 m_{t-1} + \beta_3 g_t \\
        \theta_t &= \theta_{t-1}
            - \eta\left(\frac{m_t/(1-\beta_1^t)}{d_t} + \lambda\theta_{t-1}\right)

    With ``reg_inside_moment``: :math:`m_t = \beta_1 m_{t-1} + \beta_3 (g_t/d_t + \lambda\theta)`,
    :math:`\theta_t = \theta_{t-1} - \eta\, m_t/(1-\beta_1^t)`. :math:`v_1 = n_1` unless
    ``init_zero``; :math:`\beta_3 = 1-\beta_1` with ``grad_averaging``, else 1.

    Args:
        lr (1e-3), bias_correction (True), betas ((0.9, 0.999)), eps (1e-8), weight_decay (0),
        reg_inside_moment (False), grad_averaging (True), norm_type (2; or 0),
        init_zero (False), set_grad_none (True): Apex's. amsgrad: not supported (raises).
        master_weights: keep fp32 master copies of fp16/bf16 params (mpnb extension).

    Example::

        >>> opt = FusedNovoGrad(model.parameters(), lr=1e-2, weight_decay=1e-3)
    """

    _state_keys = ("exp_avg",)
    # The grad norms of every bucket are computed before any update and their pass flags
    # inf/NaN (norm_type 2), so the separate finite pre-pass would read the grads twice.
    _check_grads = False
    multi_tensor_novograd = staticmethod(amp_C.multi_tensor_novograd)  # Apex's attributes
    multi_tensor_l2norm = staticmethod(amp_C.multi_tensor_l2norm)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        reg_inside_moment: bool = False,
        grad_averaging: bool = True,
        norm_type: int = 2,
        init_zero: bool = False,
        set_grad_none: bool = True,
        master_weights: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant.")
        if norm_type not in (0, 2):
            raise ValueError(
                f"FusedNovoGrad: norm_type must be 0 (max) or 2 (L2), got {norm_type}."
            )
        check_hyperparams("FusedNovoGrad", lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            norm_type=norm_type,
            init_zero=init_zero,
        )
        super().__init__(
            params, defaults, master_weights=master_weights, set_grad_none=set_grad_none
        )
        self.reg_inside_moment = bool(reg_inside_moment)

    def _init_state(self, p, state) -> None:
        super()._init_state(p, state)
        state["exp_avg_sq"] = torch.zeros((), dtype=torch.float32, device=p.device)

    @staticmethod
    def _grad_norms(grads, norm_type, inv_scale, found_inf) -> torch.Tensor:
        if norm_type == 2:
            flag = found_inf if found_inf is not None else torch.zeros(1, device=grads[0].device)
            return multi_tensor_l2norm(flag, grads, True, inv_scale)[1].float().contiguous()
        if found_inf is not None:
            multi_tensor_check_finite(found_inf, grads)
        norms = torch.stack([g.abs().max().float() for g in grads])
        return (norms if inv_scale is None else norms * inv_scale).contiguous()

    def _prepare(self, work, inv_scale, found_inf) -> None:
        # Every bucket's norms (and the overflow verdict) before the first write.
        self._norms = {
            id(b): self._grad_norms(b.grads, group["norm_type"], inv_scale, found_inf)
            for group, buckets in work
            for b in buckets
        }

    def _update(self, group, bucket, inv_scale, found_inf) -> None:
        # A set found_inf skips the step inside the op, on the device.
        beta1, beta2 = group["betas"]
        fused_novograd_(
            bucket.params,
            bucket.grads,
            self.state_list(bucket, "exp_avg"),
            self.state_list(bucket, "exp_avg_sq"),
            bucket.masters,
            self.state_list(bucket, "step"),
            self._norms.pop(id(bucket)),
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            **self.group_args(group, "fused_novograd_"),
            reg_inside_moment=self.reg_inside_moment,
            inv_scale=inv_scale,
            found_inf=found_inf,
        )
