"""FusedSGD: Apex's fused SGD with momentum, as a C++ multi-tensor kernel on the CPU."""

from __future__ import annotations

from functools import partial

import torch
from torch.optim.optimizer import required

from mpnb.core import amp_C
from mpnb.core.ops.sgd import fused_sgd_, fused_sgd_bf16_
from mpnb.core.optimizers._base import FusedOptimizerBase, check_hyperparams

__all__ = ["FusedSGD"]


class FusedSGD(FusedOptimizerBase):
    r"""SGD with momentum, Nesterov and weight decay (Apex's FusedSGD), fused.

    .. math::
        g_t &= \nabla_\theta + \lambda\theta_{t-1}, \qquad
        b_t = \mu b_{t-1} + (1-\tau) g_t \;\; (b_1 = g_1) \\
        g_t &\leftarrow g_t + \mu b_t \text{ (nesterov) or } b_t, \qquad
        \theta_t = \theta_{t-1} - \eta g_t

    With ``wd_after_momentum`` the :math:`\lambda\theta` term is added after the momentum
    instead (Apex). The arithmetic and the state (``momentum_buffer``) are those of
    ``torch.optim.SGD``, so checkpoints load into either optimizer.

    Half params updated directly (no master weights): by default the momentum buffer is fp32
    and each step computes in fp32 and rounds the weight once. ``stepwise_rounding=True``
    keeps the buffer in the param's dtype and rounds every operation to it, as
    ``torch.optim.SGD`` does on half tensors (bit for bit as ATen's vectorized CPU kernels
    compute it): the rule Apex's tests hold FusedSGD to, and what the Apex alias serves
    (:mod:`mpnb.compat.apex_rules`). The default is the nearer to the exact (fp64)
    trajectory: as near (within 0.3%) with plain momentum, 11% nearer with momentum 0.9 and
    weight decay (200 steps, fp16 and bf16; ``tests/core/optimizers/test_fused_sgd.py``).

    Args:
        lr, momentum, dampening (:math:`\tau`), weight_decay, nesterov: as in torch.optim.SGD.
        wd_after_momentum: add the decay after the momentum (Apex).
        materialize_master_grads: with master weights, first write the unscaled fp32 grad into
            ``master.grad`` (Apex's default, two passes); False reads the half grad directly
            in the update pass (the one-pass step).
        set_grad_none: ``zero_grad()`` sets grads to None (default False, as in Apex).
        master_weights: keep fp32 master copies of fp16/bf16 params (mpnb extension).
        stochastic_rounding, kahan_summation, generator: pure bf16 training, as in
            :class:`~mpnb.core.optimizers.FusedAdam` (exclusive with each other and with
            master weights).
        stepwise_rounding: for half params without master weights, torch.optim.SGD's
            rounding and state (see above); no effect on fp32 params or with master weights.

    Example::

        >>> opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    """

    multi_tensor_sgd = staticmethod(amp_C.multi_tensor_sgd)  # Apex's attribute

    def __init__(
        self,
        params,
        lr: float = required,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        set_grad_none: bool = False,
        master_weights: bool = False,
        stochastic_rounding: bool = False,
        kahan_summation: bool = False,
        generator: torch.Generator | None = None,
        stepwise_rounding: bool = False,
    ) -> None:
        check_hyperparams(
            "FusedSGD", lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay
        )
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(
                "Nesterov momentum requires a momentum and zero dampening; pass "
                "momentum > 0 and dampening=0, or nesterov=False."
            )
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
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
        self.wd_after_momentum = bool(wd_after_momentum)
        self.materialize_master_grads = bool(materialize_master_grads)
        self.stepwise_rounding = bool(stepwise_rounding)

    def _stepwise(self, group, bucket) -> bool:
        """torch.optim.SGD's rounding for this bucket: asked for, and the params updated
        directly (no masters, no stochastic rounding or Kahan summation)."""
        return self.stepwise_rounding and not bucket.masters and self.rounding(group) is None

    def _update(self, group, bucket, inv_scale, found_inf) -> None:
        momentum = group["momentum"]
        bufs, first, new = [], [], []
        if momentum != 0:
            cached = bucket.lists.get("momentum_buffer")  # set once every buffer exists
            if cached is not None:
                bufs, first = cached, bucket.lists["first_run"]
            else:
                # the param dtype with torch's rounding (and torch's state), else fp32
                dtype = bucket.params[0].dtype if self._stepwise(group, bucket) else torch.float32
                for p, s in zip(bucket.params, bucket.states, strict=True):
                    if s.get("momentum_buffer") is None:
                        new.append((s, torch.empty_like(p, dtype=dtype)))
                        bufs.append(new[-1][1])
                        first.append(True)
                    else:
                        if s["momentum_buffer"].dtype != dtype:  # loaded as fp32
                            s["momentum_buffer"] = s["momentum_buffer"].to(dtype)
                        bufs.append(s["momentum_buffer"])
                        first.append(False)
                if not new:
                    bucket.lists["momentum_buffer"], bucket.lists["first_run"] = bufs, first
        grads = bucket.grads
        if bucket.masters and self.materialize_master_grads:
            # Apex's master grads, unscaled
            for m, g in zip(bucket.masters, bucket.grads, strict=True):
                m.grad = g.float() if inv_scale is None else g.float() * inv_scale
            grads, inv_scale = [m.grad for m in bucket.masters], None
        rounded = self.rounding_args(group, bucket)
        if rounded is None:
            op = partial(fused_sgd_, stepwise=self._stepwise(group, bucket))
            fourth = bucket.masters
        else:
            fourth = rounded.pop("compensations")
            op = partial(fused_sgd_bf16_, **rounded)
        op(
            bucket.params,
            grads,
            bufs,
            fourth,
            first,
            lr=float(group["lr"]),
            **self.group_args(group, "fused_sgd_"),
            wd_after_momentum=self.wd_after_momentum,
            inv_scale=inv_scale,
            found_inf=found_inf,
        )
        # A buffer joins the state only once a step has really written it (one host read of
        # found_inf, on the first step only), so a skipped first step stays a first step.
        if new and (found_inf is None or found_inf.item() == 0):
            for s, buf in new:
                s["momentum_buffer"] = buf
