"""What a distributed policy may be, and what its wrap builds: the policy's allowed strategies,
dtypes and amp levels, the checks that refuse a policy :meth:`~mpnb.core.precision_configs.
_distributed.DistributedConfig.wrap` could not honour, and :class:`WrapPlan`, the one record of
what ``wrap`` builds (``wrap`` follows it, the row's precision text is read from it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpnb.core.dtype_names import short_name

__all__ = ["AMP_LEVELS", "DTYPES", "STRATEGIES", "WrapPlan", "ddp_refusal", "tolerance_refusal"]

#: the strategies a policy may have, in table order
STRATEGIES = ("ddp", "fsdp2")

#: the dtypes a policy's parameters compute in and its gradients travel in
DTYPES = ("float32", "bfloat16", "float16")

#: the amp levels a DDP policy trains under with mpnb's DDP: O2's half model (fp32 master
#: weights in the optimizer), whose half gradients are all-reduced as they are
AMP_LEVELS = ("O2",)


def ddp_refusal(param: str, reduce: str, compress: str, amp: str) -> str:
    """Why a DDP policy's dtypes are not what its wrapper does (``""``: they are)."""
    if amp:
        if param == "float32":
            return (
                f"amp_level={amp!r} casts the model to a half dtype: param_dtype must be "
                "'bfloat16' or 'float16' (for fp32 parameters use amp_level='')."
            )
        if reduce != param or compress:
            return (
                f"mpnb's DDP all-reduces amp {amp}'s {param} gradients as they are: set "
                f"reduce_dtype={param!r} and compress=''."
            )
        return ""
    if param != "float32":
        return (
            f"param_dtype={param!r}: PyTorch's DDP trains the fp32 model as it is, so its "
            f"parameters stay float32; for {param} parameters use amp_level='O2' (mpnb amp with "
            "mpnb's DDP) or strategy='fsdp2' (its MixedPrecisionPolicy)."
        )
    if compress and reduce != compress:
        return (
            f"compress={compress!r} sends the gradients in {compress}, not {reduce}; set "
            f"reduce_dtype={compress!r} (the dtype on the wire)."
        )
    if not compress and reduce != "float32":
        return (
            f"reduce_dtype={reduce!r}: PyTorch's DDP all-reduces the fp32 gradients as they "
            f"are; to send them in {reduce}, set compress={reduce!r} (its compression hook)."
        )
    return ""


def tolerance_refusal(tolerance: float) -> str:
    """Why ``tolerance`` is not a loss tolerance (``""``: it is one)."""
    if isinstance(tolerance, (int, float)) and math.isfinite(tolerance) and tolerance > 0:
        return ""
    return (
        f"tolerance={tolerance!r}: give the largest loss difference allowed against "
        "single-process fp32, a positive number (1e-4 for fp32, 2e-2 for a bf16 rounding)."
    )


@dataclass(frozen=True)
class WrapPlan:
    """What :meth:`DistributedConfig.wrap` builds, read from the policy once: ``wrap`` follows
    it and the row's precision text says it, so the row states what ran.

    Attributes:
        wrapper: ``"torch-ddp"`` (PyTorch's DDP of the fp32 model), ``"mpnb-amp-ddp"``
            (``mpnb.amp.initialize``, then mpnb's DDP) or ``"fsdp2"`` (``fully_shard``).
        param: dtype name the forward and backward compute with.
        wire: dtype name the gradients cross the ranks in.
        collective: ``"all-reduce"`` (DDP) or ``"reduce-scatter"`` (FSDP2).
        hook: the PyTorch comm hook DDP runs (``"bf16_compress_hook"``), or ``""``.
        amp_level: the mpnb amp level, or ``""``.
    """

    wrapper: str
    param: str
    wire: str
    collective: str
    hook: str = ""
    amp_level: str = ""

    def text(self) -> str:
        """``"fp32 params, bf16 all-reduce (bf16_compress_hook)"``: the row's precision cell."""
        masters = f" + fp32 masters (amp {self.amp_level})" if self.amp_level else ""
        hook = f" ({self.hook})" if self.hook else ""
        return (
            f"{short_name(self.param)} params{masters}, "
            f"{short_name(self.wire)} {self.collective}{hook}"
        )
