"""Apex's name of :mod:`mpnb.core.optimizers`; see mpnb.compat.names."""

from mpnb.core.optimizers import *  # noqa: F401,F403
from mpnb.core.optimizers import __all__  # noqa: F401
