"""One definition of each amp concept the lab and users name: half dtypes and loss scales.

:data:`HALF_DTYPES` and :func:`parse_half_dtype` are the half-dtype names every entry point
accepts (defined with the other dtype names in :mod:`mpnb.core.dtype_names`, re-exported here);
:class:`LossScaleRule` (defined in :mod:`mpnb.core.amp._rule`, re-exported here) is the loss
scaler's rule, and :meth:`LossScaleRule.parse` turns anything a user may pass as
``loss_scale`` into one. The opt levels live in :mod:`mpnb.core.opt_levels`.
"""

from __future__ import annotations

from mpnb.core.amp._rule import LossScaleRule, parse_loss_scale
from mpnb.core.dtype_names import HALF_DTYPES, half_dtype_name, parse_half_dtype

__all__ = [
    "HALF_DTYPES",
    "LossScaleRule",
    "half_dtype_name",
    "parse_half_dtype",
    "parse_loss_scale",
]
