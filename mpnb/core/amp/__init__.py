"""``mpnb.amp``: Apex's automatic mixed precision (O0-O3) on modern PyTorch, CPU and CUDA.

O1 runs the forward under ``torch.autocast`` (entered by forward hooks) and casts the model's
outputs to fp32; O2 casts the model to half (batch norms fp32) with fp32 master weights placed
in ``optimizer.param_groups``; O3 is pure half. Loss scaling is an explicit
:class:`LossScaler` per loss, following its :class:`LossScaleRule`, on the device, with one host
sync per optimizer step.

Apex's older API is here too: ``handle = amp.init()`` casts function by function until
``handle._deactivate()`` (:mod:`mpnb.core.amp.init_api`, a ``TorchFunctionMode``).

The names the lab and other front ends share are defined here once: :data:`OPT_LEVELS`,
:data:`HALF_DTYPES` with :func:`parse_half_dtype`, and :func:`parse_loss_scale`.

Example::

    >>> from mpnb import amp
    >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
    ...     scaled_loss.backward()
    >>> optimizer.step()
"""

from mpnb.core.amp._config import (
    HALF_DTYPES,
    LossScaleRule,
    half_dtype_name,
    parse_half_dtype,
    parse_loss_scale,
)
from mpnb.core.amp._initialize import EmulatedHalfWarning, PrecisionRecastWarning, initialize
from mpnb.core.amp._model import FSDP2_DTYPES, ShardedModelError
from mpnb.core.amp._properties import OPT_LEVELS, Properties, parse_opt_level, resolve_properties
from mpnb.core.amp._state import AmpOptimizerState, AmpStash, OptState
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
    preserve_current_handle,
    scale_loss,
    state_dict,
)
from mpnb.core.amp.handle import AmpHandle, RoundedWeightsWarning
from mpnb.core.amp.init_api import InitHandle, NoOpHandle, init
from mpnb.core.amp.scaler import LossScaleCollapseError, LossScaler, StaticScaleOverflowWarning

__all__ = [
    "FSDP2_DTYPES",
    "ShardedModelError",
    "initialize",
    "init",
    "InitHandle",
    "NoOpHandle",
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
    "preserve_current_handle",
    "AmpHandle",
    "AmpOptimizerState",
    "AmpStash",
    "OptState",
    "LossScaler",
    "LossScaleRule",
    "LossScaleCollapseError",
    "Properties",
    "OPT_LEVELS",
    "HALF_DTYPES",
    "parse_opt_level",
    "parse_half_dtype",
    "half_dtype_name",
    "parse_loss_scale",
    "resolve_properties",
    "EmulatedHalfWarning",
    "PrecisionRecastWarning",
    "RoundedWeightsWarning",
    "StaticScaleOverflowWarning",
]
