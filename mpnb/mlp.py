"""Apex's name of :mod:`mpnb.core.mlp`; see mpnb.compat.names."""

from mpnb.core.mlp import *  # noqa: F401,F403
from mpnb.core.mlp import __all__  # noqa: F401
