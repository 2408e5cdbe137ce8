"""The former home of the precision configurations, kept so that existing imports work:
everything here is :mod:`mpnb.core.precision_configs` (import it from there)."""

from mpnb.core.precision_configs import *  # noqa: F403
from mpnb.core.precision_configs import __all__  # noqa: F401
