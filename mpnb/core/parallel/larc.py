"""LARC: layer-wise adaptive rate control around any optimizer (Apex's ``parallel.LARC``)."""

from __future__ import annotations

import torch

from mpnb.core._numbers import positive_finite
from mpnb.core.ops import multi_tensor_l2norm

__all__ = ["LARC"]


class LARC:
    r"""Wrap ``optimizer`` so that each param's grad is rescaled by its trust ratio first.

    .. math::
        \text{lr}_{\text{local}} = c\,\frac{\lVert\theta\rVert}
            {\lVert g\rVert + \lambda\lVert\theta\rVert + \epsilon}, \qquad
        g \leftarrow (g + \lambda\theta)\cdot
        \begin{cases} \min(\text{lr}_{\text{local}}/\eta, 1) & \text{clip mode} \\
                      \text{lr}_{\text{local}} & \text{scale mode} \end{cases}

    (only where both norms are nonzero), after which the wrapped optimizer steps with its
    weight decay set to 0 (the decay is already in :math:`g`). The norms come from one
    multi-tensor kernel call per group (``mpnb::multi_tensor_l2norm``) and the rescale is a
    foreach op: no host sync.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (anything else is refused here, not at the
            first step).
        trust_coefficient: :math:`c` (default 0.02), a positive finite number: a negative
            one would turn every step into gradient ascent.
        clip: clip mode (True, default) or scale mode (False).
        eps: :math:`\epsilon` (default 1e-8), a finite number >= 0.

    Example::

        >>> opt = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        >>> loss.backward(); opt.step()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        trust_coefficient: float = 0.02,
        clip: bool = True,
        eps: float = 1e-8,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"LARC: optimizer must be a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}; build the optimizer first and wrap it: "
                "LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))."
            )
        if not isinstance(clip, bool) and clip not in (0, 1):  # Apex scripts pass 0/1 too
            raise TypeError(
                f"LARC: clip must be True (clip mode) or False (scale mode), got {clip!r}."
            )
        self.optim = optimizer
        # c < 0 flips every grad (gradient ascent), c = 0 zeroes them: neither trains.
        self.trust_coefficient = positive_finite(
            trust_coefficient,
            "trust_coefficient",
            owner="LARC",
            fix="pass trust_coefficient= a positive number (default 0.02); a negative one "
            "flips every gradient (gradient ascent) and 0 zeroes them",
        )
        self.clip = bool(clip)
        self.eps = positive_finite(eps, "eps", owner="LARC", allow_zero=True)

    def __getstate__(self):
        return self.optim.__getstate__()

    def __setstate__(self, state):
        self.optim.__setstate__(state)

    @property
    def state(self):
        return self.optim.state

    def __repr__(self) -> str:
        return f"LARC({self.optim!r}, trust_coefficient={self.trust_coefficient}, clip={self.clip})"

    @property
    def param_groups(self):
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optim.param_groups = value

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True):
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):
        self.optim.add_param_group(param_group)

    @torch.no_grad()
    def _adjust(self, group: dict, weight_decay: float) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        for dtype in {p.dtype for p in params}:
            ps = [p.detach() for p in params if p.dtype == dtype]
            gs = [p.grad for p in params if p.dtype == dtype]
            flag = torch.zeros(1, device=ps[0].device)
            _, pn = multi_tensor_l2norm(flag, ps, True)
            _, gn = multi_tensor_l2norm(flag, gs, True)
            local = self.trust_coefficient * pn / (gn + pn * weight_decay + self.eps)
            if self.clip:
                local = torch.clamp(local / group["lr"], max=1.0)
            local = torch.where((pn != 0) & (gn != 0), local, torch.ones_like(local))
            if weight_decay != 0:
                keep = ((pn != 0) & (gn != 0)).to(pn.dtype) * weight_decay
                torch._foreach_add_(gs, torch._foreach_mul(ps, list(keep.to(dtype).unbind())))
            torch._foreach_mul_(gs, list(local.to(dtype).unbind()))

    def step(self, closure=None):
        """Rescale every grad by its trust ratio, then step the wrapped optimizer."""
        weight_decays = []
        for group in self.optim.param_groups:
            wd = group.get("weight_decay", 0)
            weight_decays.append(wd)
            group["weight_decay"] = 0
            self._adjust(group, wd)
        try:
            return self.optim.step(closure) if closure is not None else self.optim.step()
        finally:
            for group, wd in zip(self.optim.param_groups, weight_decays, strict=True):
                group["weight_decay"] = wd
