"""The dynamic loss-scale update: ``mpnb::update_scale_hysteresis`` and ``update_loss_scale_``.

A loss scaler's rule (Apex's dynamic scaling with hysteresis; PyTorch's ``GradScaler`` is the
``hysteresis=1`` case) applied in place to one-element state tensors, with no host sync: the
rule's numbers (growth and backoff factors, growth interval, hysteresis, clamp bounds) arrive
as arguments from the object that owns them (:class:`mpnb.core.amp.LossScaler`).

Kernels: ``csrc/cpu/loss_scale.cpp`` (CPU); the reference (tensor ops, no sync) elsewhere.
"""

from __future__ import annotations

import torch

from mpnb.core.ops._library import Sample, define, ensure_kernels, no_outputs

__all__ = [
    "update_scale_hysteresis",
    "update_loss_scale_",
    "reference_update_scale_hysteresis",
    "reference_update_loss_scale_",
]


def _check_scaler_state(
    current_scale,
    growth_tracker,
    hysteresis_tracker,
    found_inf,
    growth_interval,
    op: str = "update_scale_hysteresis",
):
    if current_scale.dtype != torch.float32 or current_scale.numel() != 1:
        raise TypeError(f"{op}: current_scale must be a one-element float32 tensor.")
    for name, t in (("growth_tracker", growth_tracker), ("hysteresis_tracker", hysteresis_tracker)):
        if t.dtype != torch.int32 or t.numel() != 1:
            raise TypeError(f"{op}: {name} must be a one-element int32 tensor.")
    if found_inf.numel() != 1:
        raise ValueError(f"{op}: found_inf must hold one value.")
    if growth_interval <= 0:
        raise ValueError(f"{op}: growth_interval must be positive, got {growth_interval}.")


def reference_update_scale_hysteresis(
    current_scale,
    growth_tracker,
    hysteresis_tracker,
    found_inf,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
) -> None:
    """Reference of :func:`update_scale_hysteresis`, with tensor ops only (no host sync)."""
    _check_scaler_state(
        current_scale, growth_tracker, hysteresis_tracker, found_inf, growth_interval
    )
    inf = found_inf.reshape(()).to(torch.float64)
    found = inf > 0
    nonzero = inf != 0
    hyst = hysteresis_tracker.reshape(())
    growth = growth_tracker.reshape(())
    scale = current_scale.reshape(()).to(torch.float64)
    hyst_after = torch.where(found, hyst - 1, hyst)
    held = found & (hyst_after > 0)  # inside the hysteresis window: keep the scale
    backoff = ~held & nonzero
    successful = growth + 1
    grow = ~held & ~nonzero & (successful == growth_interval)
    grown = (scale * growth_factor).to(torch.float32)
    new_scale = torch.where(
        backoff,
        (scale * backoff_factor).to(torch.float32),
        torch.where(grow & torch.isfinite(grown), grown, current_scale.reshape(())),
    )
    new_growth = torch.where(
        held | backoff | grow, torch.zeros_like(growth), torch.where(nonzero, growth, successful)
    )
    new_hyst = torch.where(held | found, hyst_after, hyst)
    new_hyst = torch.where(~held & (inf <= 0), torch.full_like(hyst, hysteresis), new_hyst)
    current_scale.copy_(new_scale.reshape(current_scale.shape))
    growth_tracker.copy_(new_growth.reshape(growth_tracker.shape))
    hysteresis_tracker.copy_(new_hyst.reshape(hysteresis_tracker.shape))


def _check_loss_scale_args(inv_scale, min_scale: float, max_scale: float) -> None:
    op = "update_loss_scale_"
    if inv_scale.dtype != torch.float32 or inv_scale.numel() != 1:
        raise TypeError(f"{op}: inv_scale must be a one-element float32 tensor.")
    if not min_scale <= max_scale:
        raise ValueError(
            f"{op}: min_scale ({min_scale}) is above max_scale ({max_scale}); pass "
            "min_scale <= max_scale."
        )


def reference_update_loss_scale_(
    current_scale,
    inv_scale,
    growth_tracker,
    hysteresis_tracker,
    found_inf,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
) -> None:
    """Reference of :func:`update_loss_scale_`: the hysteresis rule, ``clamp_``, ``reciprocal``."""
    _check_scaler_state(
        current_scale,
        growth_tracker,
        hysteresis_tracker,
        found_inf,
        growth_interval,
        "update_loss_scale_",
    )
    _check_loss_scale_args(inv_scale, min_scale, max_scale)
    reference_update_scale_hysteresis(
        current_scale,
        growth_tracker,
        hysteresis_tracker,
        found_inf,
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
    )
    current_scale.clamp_(float(min_scale), float(max_scale))
    torch.reciprocal(current_scale, out=inv_scale)


def _state(scale: float, growth: int, hyst: int):
    return (
        torch.full((1,), scale),
        torch.full((1,), growth, dtype=torch.int32),
        torch.full((1,), hyst, dtype=torch.int32),
    )


def _samples_hysteresis(dtype: torch.dtype):
    for found in (0.0, 1.0, float("nan")):
        for hyst in (1, 2):
            s, g, h = _state(65536.0, 1, hyst)
            yield Sample(
                (s, g, h, torch.full((1,), found), 2.0, 0.5, 2, 2),
                name=f"found={found} hyst={hyst}",
            )


def _samples_update(dtype: torch.dtype):
    for found in (0.0, 1.0):
        for lo, hi in ((0.0, 2.0**24), (65536.0, 65536.0 * 4)):
            s, g, h = _state(65536.0 * 2, 1, 1)
            yield Sample(
                (s, torch.empty(1), g, h, torch.full((1,), found), 2.0, 0.125, 2, 1, lo, hi),
                name=f"found={found} clamp=[{lo}, {hi}]",
            )


SCALE_DTYPES = (torch.float32,)  # the state's dtype (one-element fp32 / int32 tensors)

HYSTERESIS = define(
    "update_scale_hysteresis(Tensor(a!) current_scale, Tensor(b!) growth_tracker, "
    "Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor, "
    "float backoff_factor, int growth_interval, int hysteresis) -> ()",
    family="loss_scale",
    reference=reference_update_scale_hysteresis,
    fake=no_outputs,
    dtypes=SCALE_DTYPES,
    sample_inputs=_samples_hysteresis,
)
UPDATE = define(
    "update_loss_scale_(Tensor(a!) current_scale, Tensor(b!) inv_scale, "
    "Tensor(c!) growth_tracker, Tensor(d!) hysteresis_tracker, Tensor found_inf, "
    "float growth_factor, float backoff_factor, int growth_interval, int hysteresis, "
    "float min_scale, float max_scale) -> ()",
    family="loss_scale",
    reference=reference_update_loss_scale_,
    fake=no_outputs,
    dtypes=SCALE_DTYPES,
    sample_inputs=_samples_update,
)
_hysteresis = HYSTERESIS.overload
_update = UPDATE.overload


def update_scale_hysteresis(
    current_scale,
    growth_tracker,
    hysteresis_tracker,
    found_inf,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
) -> torch.Tensor:
    """Apex's dynamic loss-scale update with hysteresis, in place; returns ``current_scale``.

    With ``found_inf > 0`` the hysteresis tracker is decremented; while it stays positive the
    scale is kept (only the growth counter restarts). Once it reaches zero the scale is
    multiplied by ``backoff_factor``. Without an overflow the growth counter advances and
    the scale is multiplied by ``growth_factor`` every ``growth_interval`` clean steps
    (never past the fp32 range), and the hysteresis tracker is refilled to ``hysteresis``.
    With ``hysteresis=1`` this is exactly PyTorch's ``GradScaler`` update.

    Args:
        current_scale: one-element float32 tensor.
        growth_tracker, hysteresis_tracker: one-element int32 tensors.
        found_inf: one-element tensor, nonzero after an overflow.
        growth_factor, backoff_factor, growth_interval, hysteresis: the rule.

    Example::

        >>> scale = torch.full((1,), 65536.0)
        >>> g, h = torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
        >>> update_scale_hysteresis(scale, g, h, torch.ones(1), 2.0, 0.5, 2000, 1)  # 32768
    """
    ensure_kernels()
    _hysteresis(
        current_scale,
        growth_tracker,
        hysteresis_tracker,
        found_inf,
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
    )
    return current_scale


def update_loss_scale_(
    current_scale,
    inv_scale,
    growth_tracker,
    hysteresis_tracker,
    found_inf,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
) -> None:
    """One step's whole dynamic loss-scale update, in place, in one call.

    :func:`update_scale_hysteresis`, then ``current_scale`` clamped to
    ``[min_scale, max_scale]`` and ``inv_scale = 1 / current_scale``. No host sync.

    Args:
        current_scale, inv_scale: one-element float32 tensors.
        growth_tracker, hysteresis_tracker: one-element int32 tensors.
        found_inf: one-element tensor, nonzero after an overflow.
        growth_factor, backoff_factor, growth_interval, hysteresis: as in
            :func:`update_scale_hysteresis`.
        min_scale, max_scale: the clamp bounds (``0.0`` for no lower bound).

    Example::

        >>> scale, inv = torch.full((1,), 65536.0), torch.empty(1)
        >>> growth, hyst = torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
        >>> update_loss_scale_(scale, inv, growth, hyst, torch.ones(1), 2.0, 0.5, 2000, 1,
        ...                    0.0, 2.0**24)   # an overflow: scale 32768, inv 1/32768
    """
    ensure_kernels()
    _update(
        current_scale,
        inv_scale,
        growth_tracker,
        hysteresis_tracker,
        found_inf,
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
        min_scale,
        max_scale,
    )
