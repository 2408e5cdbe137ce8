"""Apex-compatible name: ``mpnb.fused_dense`` (see :mod:`mpnb.core.fused_dense`)."""

from mpnb.core.fused_dense import *  # noqa: F401,F403
from mpnb.core.fused_dense import __all__  # noqa: F401
