"""Apex-compatible name: ``mpnb.transformer.functional.fused_softmax``."""

from mpnb.core.transformer.functional.fused_softmax import *  # noqa: F401,F403
from mpnb.core.transformer.functional.fused_softmax import __all__  # noqa: F401
