"""Apex's name of :mod:`mpnb.core.transformer.functional.fused_rope`; see mpnb.compat.names."""

from mpnb.core.transformer.functional.fused_rope import *  # noqa: F401,F403
from mpnb.core.transformer.functional.fused_rope import __all__  # noqa: F401
