"""FusedMixedPrecisionLamb: LAMB on fp16/bf16 params with fp32 masters and a GradScaler."""

from __future__ import annotations

import torch

from mpnb.core.optimizers.fused_lamb import FusedLAMB

__all__ = ["FusedMixedPrecisionLamb"]


class FusedMixedPrecisionLamb(FusedLAMB):
    r"""Apex's FusedMixedPrecisionLamb: :class:`FusedLAMB` with fp32 master weights always on.

    The math is :class:`FusedLAMB`'s. Reduced-precision params (``reduced_precision_dtype``,
    fp16 or bf16) keep an fp32 master in ``state[p]["master_param"]``; each step reads the
    half grad, unscales it by the GradScaler's scale, updates master and moments and writes the
    half param in one pass, and skips everything on overflow.

    Args:
        step: the initial step count of every param (Apex's ``step`` argument).
        reduced_precision_dtype: if given, every non-fp32 param must have this dtype.
        others: as :class:`FusedLAMB`.

    Example::

        >>> scaler = torch.amp.GradScaler("cpu")
        >>> opt = FusedMixedPrecisionLamb(model.parameters(), lr=1e-3)
        >>> scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    """

    _step_supports_amp_scaling = True  # as Apex's: torch's GradScaler hands it the scale

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        step: int = 0,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        reduced_precision_dtype: torch.dtype | None = None,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            adam_w_mode=adam_w_mode,
            grad_averaging=grad_averaging,
            set_grad_none=set_grad_none,
            max_grad_norm=max_grad_norm,
            use_nvlamb=use_nvlamb,
            master_weights=True,
        )
        self.reduced_precision_dtype = reduced_precision_dtype
        self._initial_step = float(step)
        for group in self.param_groups:
            for p in group["params"]:
                if reduced_precision_dtype is not None and p.dtype not in (
                    torch.float32,
                    reduced_precision_dtype,
                ):
                    raise ValueError(
                        f"FusedMixedPrecisionLamb: a param is {p.dtype} but "
                        f"reduced_precision_dtype is {reduced_precision_dtype}; "
                        "cast the model or change reduced_precision_dtype."
                    )

    def _init_state(self, p, state) -> None:
        super()._init_state(p, state)
        state["step"].fill_(self._initial_step)
