"""Apex's name of :mod:`mpnb.core.transformer.functional.fused_softmax`; see mpnb.compat.names."""

from mpnb.core.transformer.functional.fused_softmax import *  # noqa: F401,F403
from mpnb.core.transformer.functional.fused_softmax import __all__  # noqa: F401
