"""Apex's name of :mod:`mpnb.core.multi_tensor_apply`; see mpnb.compat.names."""

from mpnb.core.multi_tensor_apply import *  # noqa: F401,F403
from mpnb.core.multi_tensor_apply import __all__  # noqa: F401
