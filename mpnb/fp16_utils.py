"""Apex's name of :mod:``; see mpnb.compat.names."""

from mpnb.core.fp16_utils import *  # noqa: F401,F403
from mpnb.core.fp16_utils import __all__  # noqa: F401
