"""Apex-compatible name: ``mpnb.mlp`` (see :mod:`mpnb.core.mlp`)."""

from mpnb.core.mlp import MLP, mlp_function

__all__ = ["MLP", "mlp_function"]
