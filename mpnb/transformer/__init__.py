"""Apex-compatible name: ``mpnb.transformer`` (see :mod:`mpnb.core.transformer`)."""

from mpnb.transformer import enums, functional
from mpnb.transformer.enums import AttnMaskType

__all__ = ["AttnMaskType", "enums", "functional"]
