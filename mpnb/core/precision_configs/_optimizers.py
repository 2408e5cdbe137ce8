"""Optimizers by name, and the fused optimizer a configuration substitutes for one.

A configuration that needs an option only mpnb's fused optimizers have (stochastic rounding,
Kahan summation) builds the fused optimizer of the same rule in place of the one named:
:data:`FUSED_FOR` says which.
"""

from __future__ import annotations

import torch

__all__ = [
    "DEFAULT_OPTIMIZER",
    "OPTIMIZERS",
    "FUSED_FOR",
    "ADAMW_DECAY",
    "make_optimizer",
    "optimizer_code",
    "substitute_note",
]

#: the optimizer names the lab, the CLI and the widgets offer
OPTIMIZERS = ("adam", "adamw", "sgd", "fused_adam", "fused_sgd")

#: what a comparison trains with when no optimizer is named: mpnb's FusedAdam, so that mpnb's
#: rows and torch-amp's (``torch.optim.AdamW(fused=True)``) both take fused steps that read
#: nothing on the host (``torch.optim.Adam``'s Python loop reads each step count: on a GPU,
#: one wait per parameter tensor per step)
DEFAULT_OPTIMIZER = "fused_adam"

#: the fused optimizer that stands in for each name when an option is needed
FUSED_FOR = {
    "adam": "fused_adam",
    "adamw": "fused_adamw",
    "fused_adam": "fused_adam",
    "sgd": "fused_sgd",
    "fused_sgd": "fused_sgd",
}

#: torch.optim.AdamW's default decoupled weight decay ("adamw" and its fused stand-in use it)
ADAMW_DECAY = 1e-2


def make_optimizer(name: str, params, lr: float, option: str | None = None):
    """A fresh optimizer by name: adam, adamw, sgd (momentum 0.9), fused_adam, fused_sgd.

    Args:
        name: one of :data:`OPTIMIZERS`.
        params: the parameters to optimize.
        lr: the learning rate.
        option: ``"stochastic_rounding"`` or ``"kahan_summation"`` (or ``"capturable"``,
            FusedAdam's only): build mpnb's fused optimizer of the same rule
            (:data:`FUSED_FOR`: Adam and AdamW -> ``FusedAdam``, SGD -> ``FusedSGD``) with
            that option set to True.

    Example::

        >>> make_optimizer("adam", model.parameters(), 1e-3, "stochastic_rounding")
        FusedAdam (...)
    """
    # mpnb.core.optimizers when one is built: +21 ms to importing the configurations
    from mpnb.core.optimizers import FusedAdam, FusedSGD

    kw = {option: True} if option else {}
    if option:
        name = FUSED_FOR[name]
    makers = {
        "adam": lambda: torch.optim.Adam(params, lr=lr),
        "adamw": lambda: torch.optim.AdamW(params, lr=lr),
        "sgd": lambda: torch.optim.SGD(params, lr=lr, momentum=0.9),
        "fused_adam": lambda: FusedAdam(params, lr=lr, **kw),
        "fused_adamw": lambda: FusedAdam(params, lr=lr, weight_decay=ADAMW_DECAY, **kw),
        "fused_sgd": lambda: FusedSGD(params, lr=lr, momentum=0.9, **kw),
    }
    return makers[name]()


def optimizer_code(name: str, lr: float, option: str | None = None) -> tuple[str, str]:
    """The code that builds what :func:`make_optimizer` builds: ``(import line, statement)``
    (the import ``""`` for ``torch.optim``'s), for a configuration's snippet.

    Example::

        >>> optimizer_code("sgd", 1e-3)[1]
        'optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)'
    """
    if option:
        name = FUSED_FOR[name]
    extra = f", {option}=True" if option else ""
    cls, args = {
        "adam": ("torch.optim.Adam", ""),
        "adamw": ("torch.optim.AdamW", ""),
        "sgd": ("torch.optim.SGD", ", momentum=0.9"),
        "fused_adam": ("FusedAdam", ""),
        "fused_adamw": ("FusedAdam", f", weight_decay={ADAMW_DECAY:g}"),
        "fused_sgd": ("FusedSGD", ", momentum=0.9"),
    }[name]
    imp = "" if cls.startswith("torch.") else f"from mpnb.optimizers import {cls}"
    return imp, f"optimizer = {cls}(model.parameters(), lr={lr!r}{args}{extra})"


def substitute_note(config: str, name: str, option: str) -> str:
    """``"bf16-pure+sr trains with mpnb's FusedAdam(stochastic_rounding=True) for 'adam'"``:
    what :func:`make_optimizer` built for ``name`` with ``option``, for a row's warnings."""
    fused = FUSED_FOR[name]
    cls = "FusedSGD" if fused == "fused_sgd" else "FusedAdam"
    mode = ", weight_decay=0.01" if fused == "fused_adamw" else ""
    return f"{config} trains with mpnb's {cls}({option}=True{mode}) for {name!r}"
