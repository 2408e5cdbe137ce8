"""mpnb.core: the Apex re-implementation (amp, fp16_utils, optimizers, normalization, ...).

Knows nothing of ``mpnb.lab`` or ``mpnb.widgets``.
"""
