"""Apex-compatible name: ``mpnb.optimizers`` (see :mod:`mpnb.core.optimizers`)."""

from mpnb.core.optimizers import *  # noqa: F401,F403
from mpnb.core.optimizers import __all__  # noqa: F401
