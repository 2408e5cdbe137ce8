"""``mpnb.fp8``: FP8 training recipes (see :mod:`mpnb.core.fp8`)."""

from mpnb.core.fp8 import *  # noqa: F401,F403
from mpnb.core.fp8 import __all__  # noqa: F401
