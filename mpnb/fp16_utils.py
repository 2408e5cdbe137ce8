"""Apex-compatible name: ``mpnb.fp16_utils`` (see :mod:`mpnb.core.fp16_utils`)."""

from mpnb.core.fp16_utils import *  # noqa: F401,F403
from mpnb.core.fp16_utils import __all__  # noqa: F401
