"""Apex-compatible name: ``mpnb.normalization`` (see :mod:`mpnb.core.normalization`)."""

from mpnb.core.normalization import *  # noqa: F401,F403
from mpnb.core.normalization import __all__  # noqa: F401
