"""Apex-compatible name: ``mpnb.amp_C`` (see :mod:`mpnb.core.amp_C`)."""

from mpnb.core.amp_C import *  # noqa: F401,F403
from mpnb.core.amp_C import __all__  # noqa: F401
