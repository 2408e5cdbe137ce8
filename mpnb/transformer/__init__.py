"""Apex's name of :mod:`mpnb.core.transformer`; see mpnb.compat.names."""

from mpnb.core.transformer import *  # noqa: F401,F403
from mpnb.core.transformer import __all__  # noqa: F401
