"""FusedAdam: Apex's fused Adam/AdamW, as a C++ multi-tensor kernel on the CPU."""

from __future__ import annotations

from functools import partial

import torch

from mpnb.core import amp_C
from mpnb.core.ops.adam import fused_adam_, fused_adam_bf16_
from mpnb.core.optimizers._base import FusedOptimizerBase, check_hyperparams

__all__ = ["FusedAdam"]


class FusedAdam(FusedOptimizerBase):
    r"""Adam (``adam_w_mode=False``: L2 decay) or AdamW (default: decoupled decay), fused.

    .. math::
        m_t &= \beta_1 m_{t-1} + (1-\beta_1) g_t, \qquad
        v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2 \\
        \theta_t &= \theta_{t-1}(1 - \eta\lambda)
            - \frac{\eta}{1-\beta_1^t}\,\frac{m_t}{\sqrt{v_t}/\sqrt{1-\beta_2^t} + \epsilon}

    (without ``adam_w_mode``, :math:`g_t \leftarrow g_t + \lambda\theta_{t-1}` instead of the
    decay factor; without ``bias_correction`` both corrections are 1). The arithmetic is
    that of ``torch.optim.AdamW(fused=True)``; state (``step``, ``exp_avg``, ``exp_avg_sq``) has
    its names and format, so checkpoints load into either optimizer.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr, betas, eps, weight_decay: as in ``torch.optim.AdamW``.
        bias_correction: apply Adam's bias correction (default True).
        adam_w_mode: decoupled weight decay (AdamW, default) or L2 decay (Adam).
        amsgrad: not supported (raises, as Apex does).
        set_grad_none: ``zero_grad()`` sets grads to None (default True).
        capturable: as in Apex, the learning rate lives on the device (each group's ``lr``
            becomes a one-element float32 tensor on its params' device, read by the kernel:
            a step captured in a CUDA graph follows an LR schedule, which fills that tensor
            in place), and ``torch.amp.GradScaler.step`` hands this optimizer its scale
            (``_step_supports_amp_scaling``): the step unscales, checks and updates in one
            pass and leaves the unscaled grads in ``.grad``. Without it GradScaler unscales
            the grads before ``step()``. (The step count always lives in a tensor; a tensor
            passed as ``lr`` is read on the device without ``capturable`` too.)
        master_weights: keep fp32 master copies of fp16/bf16 params; each step reads the half
            grad, updates the master and writes the half param in one pass.
        stochastic_rounding: pure bf16 training: bf16 params (no masters) are updated in
            fp32 and rounded stochastically back to bf16, unbiased, so updates below half a
            bf16 ulp survive in expectation (math: :mod:`mpnb.core.ops._rounding`).
        kahan_summation: pure bf16 training with a bf16 compensation buffer per param
            (``state[p]["compensation"]``, 2 bytes per param) that carries what each
            rounding lost into the next step. Exclusive with ``stochastic_rounding``.
        generator: the ``torch.Generator`` the stochastic rounding's seed is drawn from,
            once, here (default: torch's default generator); the seed and the step count of
            the random bits are saved in ``state_dict()["rounding"]``, so a resumed run
            rounds bitwise as an uninterrupted one.

    Apex's ``multi_tensor_adam`` and ``_dummy_overflow_buf`` attributes are there for code that
    subclasses Apex's FusedAdam (``multi_tensor_applier(self.multi_tensor_adam, ...)``).

    Example::

        >>> model = torch.nn.Linear(4, 4)
        >>> opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> model(torch.randn(2, 4)).sum().backward()
        >>> opt.step()
    """

    _state_keys = ("exp_avg", "exp_avg_sq")
    multi_tensor_adam = staticmethod(amp_C.multi_tensor_adam)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        stochastic_rounding: bool = False,
        kahan_summation: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        if amsgrad:
            raise RuntimeError(
                "FusedAdam does not support the AMSGrad variant; use "
                "torch.optim.AdamW(amsgrad=True) instead."
            )
        check_hyperparams("FusedAdam", lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay
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
        self.capturable = bool(capturable)
        # Apex: only the capturable step takes torch.amp.GradScaler's scale (and leaves the
        # unscaled grads behind); otherwise GradScaler unscales the grads before step().
        self._step_supports_amp_scaling = self.capturable
        for group in self.param_groups:
            self._place_lr(group)

    def _place_lr(self, group: dict) -> None:
        # Capturable (Apex's rule): the group's lr becomes a float32 tensor on its params'
        # device, which the kernel reads there; torch's LR schedulers fill it in place.
        if not getattr(self, "capturable", False) or not group["params"]:
            return
        lr, device = group["lr"], group["params"][0].device
        if isinstance(lr, torch.Tensor) and lr.device == device and lr.dtype == torch.float32:
            return
        group["lr"] = torch.as_tensor(lr, dtype=torch.float32).reshape(()).to(device)

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group``; a capturable optimizer's new group gets
        its lr on the device, as the constructor's groups do."""
        super().add_param_group(param_group)
        self._place_lr(self.param_groups[-1])

    def load_state_dict(self, state_dict: dict) -> None:
        """As :meth:`FusedOptimizerBase.load_state_dict`; a capturable optimizer keeps each
        group's lr tensor (the one a captured step reads) and copies the saved value into it,
        and one that is not capturable takes a saved lr tensor as a number."""
        kept = [g["lr"] if isinstance(g["lr"], torch.Tensor) else None for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, old in zip(self.param_groups, kept, strict=True):
            saved = group["lr"]
            if old is not None and self.capturable:
                old.copy_(torch.as_tensor(saved, dtype=torch.float32).reshape(()))
                group["lr"] = old
            elif isinstance(saved, torch.Tensor) and not self.capturable:
                group["lr"] = float(saved)

    def _update(self, group, bucket, inv_scale, found_inf) -> None:
        beta1, beta2 = group["betas"]
        rounded = self.rounding_args(group, bucket)
        if rounded is None:
            op, fourth = fused_adam_, bucket.masters
        else:
            fourth = rounded.pop("compensations")
            op = partial(fused_adam_bf16_, **rounded)
        op(
            bucket.params,
            bucket.grads,
            self.state_list(bucket, "exp_avg"),
            self.state_list(bucket, "exp_avg_sq"),
            fourth,
            self.state_list(bucket, "step"),
            **self.lr_args(group),
            beta1=beta1,
            beta2=beta2,
            **self.group_args(group, "fused_adam_"),
            adam_w_mode=self.adam_w_mode,
            inv_scale=inv_scale,
            found_inf=found_inf,
        )
