"""Apex-compatible name: ``mpnb.transformer.functional``."""

from mpnb.core.transformer.functional import *  # noqa: F401,F403
from mpnb.core.transformer.functional import __all__  # noqa: F401
