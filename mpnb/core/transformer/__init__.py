"""Apex's ``apex.transformer`` (the fused-kernel parts): ``enums`` and ``functional``."""

from mpnb.core.transformer import enums, functional
from mpnb.core.transformer.enums import AttnMaskType

__all__ = ["AttnMaskType", "enums", "functional"]
