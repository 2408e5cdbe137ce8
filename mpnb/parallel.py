"""Apex-compatible name: ``mpnb.parallel`` (see :mod:`mpnb.core.parallel`)."""

from mpnb.core.parallel import *  # noqa: F401,F403
from mpnb.core.parallel import __all__  # noqa: F401
