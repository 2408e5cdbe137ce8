"""Multi-tensor ops: typed wrappers, pure-PyTorch references and fake kernels.

Each public function here has one signature and three possible bodies: the compiled CPU
kernel (``torch.ops.mpnb.<name>``), PyTorch's own ops on CUDA, and the reference
``reference_<name>`` (used when the kernels are not built, or with ``MPNB_DISABLE_EXT=1``).
The references define the semantics; the kernels are tested against them.

Flag semantics follow Apex's ``amp_C``: an op sets ``noop_flag`` to 1 when it meets a
non-finite value and never clears it; none of these ops skip their work when the flag is
already set (they propagate infs/NaNs, as Apex's do).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpnb.core.ops._registry import OpInfo, op_caller, register_fake, register_op, use_kernel

__all__ = [
    "multi_tensor_scale",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_check_finite",
    "update_scale_hysteresis",
    "update_loss_scale_",
    "reference_multi_tensor_scale",
    "reference_multi_tensor_axpby",
    "reference_multi_tensor_l2norm",
    "reference_multi_tensor_check_finite",
    "reference_update_scale_hysteresis",
    "reference_update_loss_scale_",
]

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ---- validation (reference path; the kernel validates in C++ with the same messages) ----


def _check_lists(op: str, first: Sequence[torch.Tensor], **others: Sequence[torch.Tensor]) -> None:
    n = len(first)
    for name, lst in others.items():
        if len(lst) != n:
            raise ValueError(
                f"{op}: list '{name}' has {len(lst)} tensors but the first list has {n}; "
                "pass lists of equal length."
            )
        for i, (a, b) in enumerate(zip(first, lst, strict=True)):
            if a.numel() != b.numel():
                raise ValueError(
                    f"{op}: tensor {i} of '{name}' has {b.numel()} elements but its partner has "
                    f"{a.numel()}; pair tensors of the same size."
                )
    for name, lst in {"first": first, **others}.items():
        if not lst:
            continue
        dtype = lst[0].dtype
        if dtype not in _SUPPORTED:
            raise TypeError(
                f"{op}: list '{name}' is {dtype}; supported dtypes are float32, float16, "
                "bfloat16 and float64."
            )
        for i, t in enumerate(lst):
            if t.dtype != dtype:
                raise TypeError(
                    f"{op}: tensor {i} of '{name}' is {t.dtype} but tensor 0 is {dtype}; every "
                    "tensor of one list must share a dtype."
                )
            if not t.is_contiguous():
                raise ValueError(
                    f"{op}: tensor {i} of '{name}' is not contiguous; call .contiguous() first."
                )
    dtypes = {lst[0].dtype for lst in (first, *others.values()) if lst}
    if torch.float64 in dtypes and len(dtypes) > 1:
        raise TypeError(f"{op}: float64 lists can only be mixed with float64 lists, got {dtypes}.")


def _opmath(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _raise_flag_if(flag: torch.Tensor, bad: torch.Tensor) -> None:
    # Device-side (no host sync): flag = max(flag, bad).
    flag.copy_(torch.maximum(flag, bad.to(flag.dtype).reshape(flag.shape)))


def _any_nonfinite(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack([~torch.isfinite(t).all() for t in tensors]).any()


def _as_list(x) -> list[torch.Tensor]:
    return list(x) if not isinstance(x, list) else x


def _foreach_ok(*lists: Sequence[torch.Tensor]) -> bool:
    """PyTorch's fused foreach ops serve devices without a kernel of ours (CUDA)."""
    t = next((lst[0] for lst in lists if lst), None)
    return t is not None and t.device.type != "cpu"


# ---- scale --------------------------------------------------------------------------------


def _foreach_multi_tensor_scale(noop_flag, src, dst, scale, scale_tensor=None) -> bool:
    """PyTorch's fused path for fp32 destinations; returns False where its semantics differ.

    Widening into fp32 is exact, so checking ``dst`` after the copy is checking ``src``, and
    ``_amp_foreach_non_finite_check_and_unscale_`` multiplies in fp32 exactly as the reference.
    """
    if not src or any(t.dtype != torch.float32 for t in dst) or src[0].dtype == torch.float64:
        return False
    aliased = any(a.numel() and a.data_ptr() == b.data_ptr() for a, b in zip(src, dst, strict=True))
    if aliased and src[0].dtype != torch.float32:
        return False
    s = torch.tensor([scale], dtype=torch.float32, device=dst[0].device)
    if scale_tensor is not None:
        s = s * scale_tensor.to(device=s.device, dtype=torch.float32).reshape(1)
    found = torch.zeros(1, dtype=torch.float32, device=dst[0].device)
    torch._foreach_copy_(list(dst), list(src))
    torch._amp_foreach_non_finite_check_and_unscale_(list(dst), found, s)
    _raise_flag_if(noop_flag, found > 0)
    return True


def reference_multi_tensor_scale(
    noop_flag: torch.Tensor,
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    scale: float,
    scale_tensor: torch.Tensor | None = None,
) -> None:
    """Reference of :func:`multi_tensor_scale` in plain PyTorch."""
    _check_lists("multi_tensor_scale", src, dst=dst)
    if not src:
        return
    acc = _opmath(src[0])
    s = torch.tensor(scale, dtype=acc, device=src[0].device)
    if scale_tensor is not None:
        s = s * scale_tensor.to(device=s.device, dtype=acc).reshape(())
    for a, b in zip(src, dst, strict=True):
        b.copy_(a.to(acc) * s)
    _raise_flag_if(noop_flag, _any_nonfinite(src, noop_flag.device))


def multi_tensor_scale(
    noop_flag: torch.Tensor,
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    scale: float,
    scale_tensor: torch.Tensor | None = None,
) -> None:
    """``dst[i] = src[i] * scale`` for every pair, in one pass; flag non-finite sources.

    The lists may have different dtypes (for example bf16 model grads into fp32 master grads:
    the unscale of a loss-scaled backward). Each element is read once, checked, multiplied
    in fp32 (fp64 for fp64 lists) and written once.

    Args:
        noop_flag: a one-element tensor set to 1 when any source value is inf or NaN.
        src: contiguous tensors to read (one dtype per list).
        dst: contiguous tensors to write, same sizes as ``src`` (may be ``src`` itself).
        scale: the factor.
        scale_tensor: optional one-element tensor multiplied into ``scale`` (a loss scaler's
            ``inv_scale`` that lives on the device).

    Example::

        >>> flag = torch.zeros(1, dtype=torch.int32)
        >>> grads = [torch.randn(10).bfloat16()]; master = [torch.empty(10)]
        >>> multi_tensor_scale(flag, grads, master, 1 / 1024)
    """
    src, dst = _as_list(src), _as_list(dst)
    if use_kernel(noop_flag, src):
        op_caller("multi_tensor_scale")(noop_flag, src, dst, float(scale), scale_tensor)
    elif not (
        _foreach_ok(src) and _foreach_multi_tensor_scale(noop_flag, src, dst, scale, scale_tensor)
    ):
        reference_multi_tensor_scale(noop_flag, src, dst, scale, scale_tensor)


@register_fake("multi_tensor_scale")
def _(noop_flag, src, dst, scale, scale_tensor=None):
    return None


# ---- axpby --------------------------------------------------------------------------------


def _check_arg_to_check(arg_to_check: int) -> None:
    if arg_to_check not in (-1, 0, 1):
        raise ValueError(
            "multi_tensor_axpby: arg_to_check must be -1 (both), 0 (x) or 1 (y), "
            f"got {arg_to_check}."
        )


def reference_multi_tensor_axpby(
    noop_flag, x, y, out, a: float, b: float, arg_to_check: int = -1
) -> None:
    """Reference of :func:`multi_tensor_axpby` in plain PyTorch."""
    _check_arg_to_check(arg_to_check)
    _check_lists("multi_tensor_axpby", x, y=y, out=out)
    if not x:
        return
    acc = _opmath(x[0])
    sa = torch.tensor(a, dtype=acc, device=x[0].device)
    sb = torch.tensor(b, dtype=acc, device=x[0].device)
    for xi, yi, oi in zip(x, y, out, strict=True):
        oi.copy_(sa * xi.to(acc) + sb * yi.to(acc))
    checked = {-1: [*x, *y], 0: list(x), 1: list(y)}[arg_to_check]
    _raise_flag_if(noop_flag, _any_nonfinite(checked, noop_flag.device))


def multi_tensor_axpby(noop_flag, x, y, out, a: float, b: float, arg_to_check: int = -1) -> None:
    """``out[i] = a * x[i] + b * y[i]`` for every triple, in one pass (Apex's axpby).

    Args:
        noop_flag: set to 1 when a checked input holds inf or NaN.
        x, y: inputs; out: outputs (each list one dtype of fp32/fp16/bf16, or all fp64).
        a, b: the scalars (rounded to fp32 for non-fp64 lists, as Apex does).
        arg_to_check: which inputs are checked for non-finite values: -1 both, 0 ``x``, 1 ``y``.
    """
    x, y, out = _as_list(x), _as_list(y), _as_list(out)
    if use_kernel(noop_flag, x):
        _check_arg_to_check(arg_to_check)
        op_caller("multi_tensor_axpby")(noop_flag, x, y, out, float(a), float(b), int(arg_to_check))
    else:
        reference_multi_tensor_axpby(noop_flag, x, y, out, a, b, arg_to_check)


@register_fake("multi_tensor_axpby")
def _(noop_flag, x, y, out, a, b, arg_to_check):
    return None


# ---- l2norm -------------------------------------------------------------------------------


def reference_multi_tensor_l2norm(noop_flag, tensors, per_tensor: bool = False, inv_scale=None):
    """Reference of :func:`multi_tensor_l2norm` in plain PyTorch (fp64 accumulation)."""
    _check_lists("multi_tensor_l2norm", tensors)
    if not tensors:
        dev = noop_flag.device
        return torch.zeros(1, device=dev), torch.empty(0, device=dev)
    acc = _opmath(tensors[0])
    dev = tensors[0].device
    inv = None
    if inv_scale is not None:
        inv = inv_scale.to(device=dev, dtype=acc).reshape(())
    sq = []
    for t in tensors:
        v = t.to(acc)
        if inv is not None:
            v = v * inv
        sq.append(v.to(torch.float64).square().sum())
    sq = torch.stack(sq)
    total = sq.sum().sqrt().reshape(1).to(acc)
    per = sq.sqrt().to(acc) if per_tensor else torch.empty(0, dtype=acc, device=dev)
    _raise_flag_if(noop_flag, ~torch.isfinite(total).all())
    return total, per


def multi_tensor_l2norm(noop_flag, tensors, per_tensor: bool = False, inv_scale=None):
    """The L2 norm of all ``tensors`` together, and optionally of each one, in one pass.

    Squares are accumulated in fp64 (Apex accumulates in fp32 and overflows past ~1.8e19),
    and the result is returned in fp32 (fp64 for fp64 inputs).

    Args:
        noop_flag: set to 1 when the norm is not finite (an input holds inf/NaN, or the norm
            exceeds the fp32 range).
        tensors: contiguous tensors of one dtype.
        per_tensor: also return each tensor's norm.
        inv_scale: optional one-element tensor; the norm is that of ``t * inv_scale`` computed
            element by element in fp32 (Apex's ``multi_tensor_unscale_l2norm``); the tensors
            are not modified.

    Returns:
        ``(total, per_tensor_norms)``: ``total`` has shape ``(1,)``; ``per_tensor_norms`` has
        shape ``(len(tensors),)``, or ``(0,)`` when ``per_tensor`` is False.
    """
    tensors = _as_list(tensors)
    if use_kernel(noop_flag, tensors):
        return op_caller("multi_tensor_l2norm")(noop_flag, tensors, bool(per_tensor), inv_scale)
    return reference_multi_tensor_l2norm(noop_flag, tensors, per_tensor, inv_scale)


@register_fake("multi_tensor_l2norm")
def _(noop_flag, tensors, per_tensor=False, inv_scale=None):
    dtype = torch.float64 if tensors and tensors[0].dtype == torch.float64 else torch.float32
    n = len(tensors) if per_tensor else 0
    dev = noop_flag.device
    return noop_flag.new_empty((1,), dtype=dtype, device=dev), noop_flag.new_empty(
        (n,), dtype=dtype, device=dev
    )


# ---- check finite -------------------------------------------------------------------------


def _foreach_multi_tensor_check_finite(noop_flag, tensors) -> None:
    """PyTorch's fused check: unscale by exactly 1.0 (bit-preserving) into a found-inf flag."""
    if not tensors:
        return
    dev = tensors[0].device
    found = torch.zeros(1, dtype=torch.float32, device=dev)
    one = torch.ones(1, dtype=torch.float32, device=dev)
    torch._amp_foreach_non_finite_check_and_unscale_(list(tensors), found, one)
    _raise_flag_if(noop_flag, found > 0)


def reference_multi_tensor_check_finite(noop_flag, tensors) -> None:
    """Reference of :func:`multi_tensor_check_finite` in plain PyTorch."""
    _check_lists("multi_tensor_check_finite", tensors)
    _raise_flag_if(noop_flag, _any_nonfinite(tensors, noop_flag.device))


def multi_tensor_check_finite(noop_flag, tensors) -> None:
    """Set ``noop_flag`` to 1 if any element of ``tensors`` is inf or NaN; read-only, one pass.

    This is what a loss scaler needs before a fused optimizer step that unscales on the fly:
    no copy, no write, just the check.
    """
    tensors = _as_list(tensors)
    if use_kernel(noop_flag, tensors):
        op_caller("multi_tensor_check_finite")(noop_flag, tensors)
    elif _foreach_ok(tensors) and tensors[0].dtype != torch.float64:
        _foreach_multi_tensor_check_finite(noop_flag, tensors)
    else:
        reference_multi_tensor_check_finite(noop_flag, tensors)


@register_fake("multi_tensor_check_finite")
def _(noop_flag, tensors):
    return None


# ---- loss scale update with hysteresis ----------------------------------------------------


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
    """
    if use_kernel(current_scale):
        op_caller("update_scale_hysteresis")(
            current_scale,
            growth_tracker,
            hysteresis_tracker,
            found_inf,
            float(growth_factor),
            float(backoff_factor),
            int(growth_interval),
            int(hysteresis),
        )
    else:
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
    return current_scale


@register_fake("update_scale_hysteresis")
def _(
    current_scale,
    growth_tracker,
    hysteresis_tracker,
    found_inf,
    growth_factor,
    backoff_factor,
    growth_interval,
    hysteresis,
):
    return None


# ---- the whole loss-scale update of one step -------------------------------------------------


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
    ``[min_scale, max_scale]`` and ``inv_scale = 1 / current_scale``: what a loss scaler
    otherwise does with three calls (the CPU kernel makes it one). No host sync on any device.

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
    if use_kernel(current_scale):
        op_caller("update_loss_scale_")(
            current_scale,
            inv_scale,
            growth_tracker,
            hysteresis_tracker,
            found_inf,
            float(growth_factor),
            float(backoff_factor),
            int(growth_interval),
            int(hysteresis),
            float(min_scale),
            float(max_scale),
        )
    else:
        reference_update_loss_scale_(
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


@register_fake("update_loss_scale_")
def _(
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
):
    return None


for _name, _ref in (
    ("multi_tensor_scale", reference_multi_tensor_scale),
    ("multi_tensor_axpby", reference_multi_tensor_axpby),
    ("multi_tensor_l2norm", reference_multi_tensor_l2norm),
    ("multi_tensor_check_finite", reference_multi_tensor_check_finite),
    ("update_scale_hysteresis", reference_update_scale_hysteresis),
    ("update_loss_scale_", reference_update_loss_scale_),
):
    register_op(OpInfo(_name, "multi_tensor", _ref))
