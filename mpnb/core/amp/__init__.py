"""``mpnb.amp``: Apex's automatic mixed precision (O0-O3) on modern PyTorch, CPU and CUDA.

O1 runs the forward under ``torch.autocast`` (entered by forward hooks); O2 casts the model to
half (batch norms fp32) with fp32 master weights placed in ``optimizer.param_groups``; O3 is
pure half. Loss scaling is an explicit :class:`LossScaler` per loss, on the device, with one
host sync per optimizer step.

Example::

    >>> from mpnb import amp
    >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
    ...     scaled_loss.backward()
    >>> optimizer.step()
"""

from mpnb.core.amp._initialize import EmulatedHalfWarning, initialize
from mpnb.core.amp._properties import OPT_LEVELS, Properties, resolve_properties
from mpnb.core.amp.casts import (
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from mpnb.core.amp.frontend import (
    current_handle,
    load_state_dict,
    master_params,
    scale_loss,
    state_dict,
)
from mpnb.core.amp.handle import AmpHandle
from mpnb.core.amp.scaler import LossScaleCollapseError, LossScaler

__all__ = [
    "initialize",
    "scale_loss",
    "master_params",
    "state_dict",
    "load_state_dict",
    "disable_casts",
    "half_function",
    "float_function",
    "promote_function",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "current_handle",
    "AmpHandle",
    "LossScaler",
    "LossScaleCollapseError",
    "Properties",
    "OPT_LEVELS",
    "resolve_properties",
    "EmulatedHalfWarning",
]
