"""Apex's name of :mod:`mpnb.core.transformer.enums`; see mpnb.compat.names."""

from mpnb.core.transformer.enums import *  # noqa: F401,F403
from mpnb.core.transformer.enums import __all__  # noqa: F401
