"""Apex's name of :mod:`mpnb.core.fused_dense`; see mpnb.compat.names."""

from mpnb.core.fused_dense import *  # noqa: F401,F403
from mpnb.core.fused_dense import __all__  # noqa: F401
