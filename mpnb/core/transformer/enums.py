"""Apex's ``apex.transformer.enums``: the attention mask types."""

import enum

__all__ = ["AttnMaskType"]


class AttnMaskType(enum.Enum):
    """How attention scores are masked: by a padding mask tensor, or causally (no tensor)."""

    padding = 1
    causal = 2
