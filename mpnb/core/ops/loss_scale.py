"""The dynamic loss-scale update: ``mpnb::update_scale_hysteresis`` and ``update_loss_scale_``.

A loss scaler's rule (Apex's dynamic scaling with hysteresis; PyTorch's ``GradScaler`` is the
``hysteresis=1`` case) applied in place to one-element state tensors, with no host sync: the
rule's numbers (growth and backoff factors, growth interval, hysteresis, clamp bounds) arrive
as arguments from the object that owns them (:class:`mpnb.core.amp.LossScaler`).

Kernels: ``csrc/cpu/loss_scale.cpp`` (CPU); the reference (tensor ops, no sync) elsewhere.
"""

from __future__ import annotations

import torch

from mpnb.core.ops._library import Sample, Tensor, define

__all__ = [
    "update_scale_hysteresis",
    "update_loss_scale_",
    "reference_update_scale_hysteresis",
    "reference_update_loss_scale_",
]


def reference_update_scale_hysteresis(
    current_scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
) -> None:
    """Apex's dynamic loss-scale update with hysteresis, in place; returns ``current_scale``.

    With ``found_inf > 0`` the hysteresis tracker is decremented; while it stays positive the
    scale is kept (only the growth counter restarts). Once it reaches zero the scale is
    multiplied by ``backoff_factor``. Without an overflow the growth counter advances and
    the scale is multiplied by ``growth_factor`` every ``growth_interval`` clean steps
    (never past the fp32 range), and the hysteresis tracker is refilled to ``hysteresis``.
    A NaN ``found_inf`` backs off without touching the hysteresis tracker; a negative one
    backs off and refills it (both as in Apex's kernel). A new scale below float32's smallest
    normal number is stored as 0, as Apex's kernel (built with ``--use_fast_math``, which
    flushes subnormals) stores it. With ``hysteresis=1`` this is PyTorch's ``GradScaler``
    update (which keeps subnormal scales instead). The reference uses tensor ops only (no
    host sync).

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
    grown = _flush_subnormal((scale * growth_factor).to(torch.float32))
    new_scale = torch.where(
        backoff,
        _flush_subnormal((scale * backoff_factor).to(torch.float32)),
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


def _flush_subnormal(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a subnormal value replaced by a zero of its sign (as a CUDA fast-math store)."""
    return torch.where(x.abs() < torch.finfo(torch.float32).tiny, x * 0.0, x)


def _check_state(args, per_tensor: bool) -> None:
    op = args.op_name
    if args.current_scale.dtype != torch.float32 or args.current_scale.numel() != 1:
        raise TypeError(f"{op}: current_scale must be a one-element float32 tensor.")
    for name in ("growth_tracker", "hysteresis_tracker"):
        t = getattr(args, name)
        if t.dtype != torch.int32 or t.numel() != 1:
            raise TypeError(f"{op}: {name} must be a one-element int32 tensor.")
    if args.found_inf.numel() != 1:
        raise ValueError(f"{op}: found_inf must hold one value.")
    if args.growth_interval <= 0:
        raise ValueError(f"{op}: growth_interval must be positive, got {args.growth_interval}.")


def reference_update_loss_scale_(
    current_scale: Tensor,
    inv_scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
) -> None:
    """One step's whole dynamic loss-scale update, in place, in one call.

    :func:`update_scale_hysteresis`, then ``current_scale`` clamped to
    ``[min_scale, max_scale]`` and ``inv_scale = 1 / current_scale``. No host sync (the
    reference: the hysteresis rule, ``clamp_``, ``reciprocal``).

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


def _check_update(args, per_tensor: bool) -> None:
    _check_state(args, per_tensor)
    op, inv_scale = args.op_name, args.inv_scale
    if inv_scale.dtype != torch.float32 or inv_scale.numel() != 1:
        raise TypeError(f"{op}: inv_scale must be a one-element float32 tensor.")
    if not args.min_scale <= args.max_scale:
        raise ValueError(
            f"{op}: min_scale ({args.min_scale}) is above max_scale ({args.max_scale}); pass "
            "min_scale <= max_scale."
        )


def _state(scale: float, growth: int, hyst: int) -> dict:
    return dict(
        current_scale=torch.full((1,), scale),
        growth_tracker=torch.full((1,), growth, dtype=torch.int32),
        hysteresis_tracker=torch.full((1,), hyst, dtype=torch.int32),
    )


def _samples_hysteresis(dtype: torch.dtype):
    rule = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    for found in (0.0, 1.0, float("nan")):
        for hyst in (1, 2):
            kw = _state(65536.0, 1, hyst) | rule | dict(hysteresis=2)
            kw["found_inf"] = torch.full((1,), found)
            yield Sample(kw, name=f"found={found} hyst={hyst}")
    tiny = float(torch.finfo(torch.float32).tiny)
    for found, scale in ((1.0, tiny), (0.0, tiny / 4)):  # backoff / growth to a subnormal
        kw = _state(scale, 1, 1) | rule | dict(hysteresis=1, found_inf=torch.full((1,), found))
        yield Sample(kw, name=f"found={found} scale={scale:g} (flush to zero)")


def _samples_update(dtype: torch.dtype):
    rule = dict(growth_factor=2.0, backoff_factor=0.125, growth_interval=2, hysteresis=1)
    for found in (0.0, 1.0):
        for lo, hi in ((0.0, 2.0**24), (65536.0, 65536.0 * 4)):
            kw = _state(65536.0 * 2, 1, 1) | rule | dict(min_scale=lo, max_scale=hi)
            kw |= dict(inv_scale=torch.empty(1), found_inf=torch.full((1,), found))
            yield Sample(kw, name=f"found={found} clamp=[{lo}, {hi}]")


SCALE_DTYPES = (torch.float32,)  # the state's dtype (one-element fp32 / int32 tensors)

HYSTERESIS = define(
    reference_update_scale_hysteresis,
    family="loss_scale",
    mutates=("current_scale", "growth_tracker", "hysteresis_tracker"),
    check=_check_state,
    returns="current_scale",
    dtypes=SCALE_DTYPES,
    sample_inputs=_samples_hysteresis,
)
update_scale_hysteresis = HYSTERESIS.wrapper

UPDATE = define(
    reference_update_loss_scale_,
    family="loss_scale",
    mutates=("current_scale", "inv_scale", "growth_tracker", "hysteresis_tracker"),
    check=_check_update,
    dtypes=SCALE_DTYPES,
    sample_inputs=_samples_update,
)
update_loss_scale_ = UPDATE.wrapper
