"""FusedAdagrad: Apex's fused Adagrad, as a C++ multi-tensor kernel on the CPU."""

from __future__ import annotations

from mpnb.core import amp_C
from mpnb.core.ops.adagrad import fused_adagrad_
from mpnb.core.optimizers._base import FusedOptimizerBase, check_hyperparams

__all__ = ["FusedAdagrad"]


class FusedAdagrad(FusedOptimizerBase):
    r"""Adagrad (Apex's FusedAdagrad), fused.

    .. math::
        g_t = \nabla_\theta + \lambda\theta_{t-1}, \qquad h_t = h_{t-1} + g_t^2, \qquad
        \theta_t = \theta_{t-1} - \eta\,\frac{g_t}{\sqrt{h_t} + \epsilon}

    With ``adagrad_w_mode`` the decay is decoupled:
    :math:`\theta_t = \theta_{t-1} - \eta\,(g_t / (\sqrt{h_t} + \epsilon) + \lambda\theta_{t-1})`.
    State (``step``, ``sum``) has ``torch.optim.Adagrad``'s names and format.

    Args:
        lr (default 1e-2), eps (default 1e-10), weight_decay: as in torch.optim.Adagrad.
        set_grad_none: ``zero_grad()`` sets grads to None (default True).
        adagrad_w_mode: decoupled weight decay (default False).
        master_weights: keep fp32 master copies of fp16/bf16 params (mpnb extension).

    Example::

        >>> opt = FusedAdagrad(model.parameters(), lr=1e-2)
    """

    _state_keys = ("sum",)
    multi_tensor_adagrad = staticmethod(amp_C.multi_tensor_adagrad)  # Apex's attribute

    def __init__(
        self,
        params,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
        adagrad_w_mode: bool = False,
        master_weights: bool = False,
    ) -> None:
        check_hyperparams("FusedAdagrad", lr=lr, eps=eps, weight_decay=weight_decay)
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, lr_decay=0.0)
        super().__init__(
            params, defaults, master_weights=master_weights, set_grad_none=set_grad_none
        )
        self.adagrad_w_mode = bool(adagrad_w_mode)

    def _update(self, group, bucket, inv_scale, found_inf) -> None:
        fused_adagrad_(
            bucket.params,
            bucket.grads,
            self.state_list(bucket, "sum"),
            bucket.masters,
            self.state_list(bucket, "step"),
            lr=float(group["lr"]),
            **self.group_args(group, "fused_adagrad_"),
            adagrad_w_mode=self.adagrad_w_mode,
            inv_scale=inv_scale,
            found_inf=found_inf,
        )
