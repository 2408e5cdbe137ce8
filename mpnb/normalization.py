"""Apex's name of :mod:`mpnb.core.normalization`; see mpnb.compat.names."""

from mpnb.core.normalization import *  # noqa: F401,F403
from mpnb.core.normalization import __all__  # noqa: F401
