"""Apex's name of :mod:`mpnb.core.amp`; see mpnb.compat.names."""

from mpnb.core.amp import *  # noqa: F401,F403
from mpnb.core.amp import __all__  # noqa: F401
