"""Apex's name of :mod:`mpnb.core.transformer.functional`; see mpnb.compat.names."""

from mpnb.core.transformer.functional import *  # noqa: F401,F403
from mpnb.core.transformer.functional import __all__  # noqa: F401
