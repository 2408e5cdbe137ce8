"""Apex-compatible name: ``mpnb.transformer.enums``."""

from mpnb.core.transformer.enums import AttnMaskType

__all__ = ["AttnMaskType"]
