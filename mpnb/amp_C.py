"""Apex's name of :mod:`mpnb.core.amp_C`; see mpnb.compat.names."""

from mpnb.core.amp_C import *  # noqa: F401,F403
from mpnb.core.amp_C import __all__  # noqa: F401
