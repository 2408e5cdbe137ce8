"""Apex-compatible name: ``mpnb.amp`` (see :mod:`mpnb.core.amp`)."""

from mpnb.core.amp import *  # noqa: F401,F403
from mpnb.core.amp import __all__  # noqa: F401
