"""Apex's name of :mod:`mpnb.core.parallel`; see mpnb.compat.names."""

from mpnb.core.parallel import *  # noqa: F401,F403
from mpnb.core.parallel import __all__  # noqa: F401
