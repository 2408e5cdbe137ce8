"""The argument checks the op families share, each message written once.

Every op's ``check(args, per_tensor)`` is built from these (:mod:`mpnb.core.ops._library`
says when it runs). ``per_tensor=False`` checks what costs O(1) per list: the lists' lengths,
the first tensor's dtype, the scalars, the shapes of single tensors. ``per_tensor=True`` adds
what needs a loop over every tensor of every list: its size against its partner's, its dtype
against its list's, its layout. The devices of every op's tensors are checked in one place,
:func:`check_devices`, which the op's definition runs (its fake, the per-tensor checks).
Messages name the problem and the fix.

Also here: the few tensor helpers the references share (``acc_dtype``, the non-finite flag).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence

import torch

__all__ = [
    "SUPPORTED",
    "acc_dtype",
    "any_nonfinite",
    "check_devices",
    "check_float",
    "check_lengths",
    "check_lists",
    "check_one",
    "check_param",
    "check_tensors",
    "dtype_names",
    "norm_rows",
    "raise_flag_if",
]

SUPPORTED = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_SUPPORTED, _F64 = frozenset(SUPPORTED), torch.float64

Tensors = Sequence[torch.Tensor]


def dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    """``"float32, float16, bfloat16 and float64"``."""
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def check_lists(
    op: str, per_tensor: bool, dtypes: Sequence[torch.dtype] = SUPPORTED, **lists: Tensors
) -> None:
    """Lists that pair up, tensor by tensor, with the first one given.

    Always: equal lengths, each list's tensor 0 of one of ``dtypes``, and float64 lists
    only beside float64 lists. With ``per_tensor``: each tensor has its partner's number of
    elements and its list's dtype and is contiguous (devices: :func:`check_devices`).

    Example::

        >>> check_lists("multi_tensor_scale", True, src=[torch.ones(3)], dst=[torch.ones(4)])
        ValueError: multi_tensor_scale: tensor 0 of 'dst' has 4 elements but its partner ...
    """
    if not check_lengths(op, **lists):
        return
    allowed = _SUPPORTED if dtypes is SUPPORTED else frozenset(dtypes)
    wide = narrow = False  # a float64 list seen, another seen (a loop: no comprehension's call)
    for name, lst in lists.items():
        dtype = lst[0].dtype
        if dtype not in allowed:
            raise TypeError(
                f"{op}: list '{name}' is {dtype}; supported dtypes are {dtype_names(dtypes)}."
            )
        if dtype is _F64:
            wide = True
        else:
            narrow = True
    if wide and narrow:
        kinds = {lst[0].dtype for lst in lists.values()}
        got = ", ".join(sorted(dtype_names([k]) for k in kinds))
        raise TypeError(f"{op}: float64 lists can only be mixed with float64 lists, got {got}.")
    if per_tensor:
        check_tensors(op, **lists)


def check_lengths(op: str, **lists: Tensors) -> int:
    """The lists' lengths all equal the first one's, which is returned (the O(1) half of
    :func:`check_lists`, for a caller that checked the dtypes itself)."""
    items = iter(lists.items())
    first, ref = next(items)
    n = len(ref)
    for name, lst in items:
        if len(lst) != n:
            raise ValueError(
                f"{op}: list '{name}' has {len(lst)} tensors but '{first}' has {n}; pass lists "
                "of equal length."
            )
    return n


_DTYPE, _DEVICE = operator.attrgetter("dtype"), operator.attrgetter("device")


def check_tensors(op: str, **lists: Tensors) -> None:
    """The per-tensor half of :func:`check_lists` (lists of equal lengths): each tensor has
    its partner's number of elements (in the first list) and its list's dtype, and is
    contiguous.

    It runs before every Triton launch (the kernels read raw addresses), so the passing case
    is a few C-level passes over each list (``map`` of the tensors' own methods); the loop
    that finds and names the offending tensor runs only when one fails.
    """
    ref = next(iter(lists.values()))
    numels = list(map(torch.Tensor.numel, ref))
    for name, lst in lists.items():
        if not lst:
            continue
        ok = (
            (lst is ref or list(map(torch.Tensor.numel, lst)) == numels)
            and len(set(map(_DTYPE, lst))) == 1
            and all(map(torch.Tensor.is_contiguous, lst))
        )
        if not ok:
            _check_tensors(op, name, lst, ref)


def _check_tensors(op: str, name: str, lst: Tensors, ref: Tensors) -> None:
    dtype = lst[0].dtype
    for i, (t, partner) in enumerate(zip(lst, ref, strict=True)):
        if t.numel() != partner.numel():
            raise ValueError(
                f"{op}: tensor {i} of '{name}' has {t.numel()} elements but its partner has "
                f"{partner.numel()}; pair tensors of the same size."
            )
        if t.dtype != dtype:
            raise TypeError(
                f"{op}: tensor {i} of '{name}' is {t.dtype} but tensor 0 is {dtype}; every "
                "tensor of one list must share a dtype."
            )
        if not t.is_contiguous():
            raise ValueError(
                f"{op}: tensor {i} of '{name}' is not contiguous; call .contiguous() first."
            )


def _tensors_of(args) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """``(where, tensor, in a list)`` for every tensor among an op's ``args``."""
    for name, value in zip(args._fields, args, strict=True):
        if isinstance(value, torch.Tensor):
            yield name, value, False
        elif isinstance(value, (list, tuple)):
            for i, t in enumerate(value):
                if isinstance(t, torch.Tensor):
                    yield f"tensor {i} of '{name}'", t, True


def check_devices(args) -> None:
    """Every tensor of an op's lists on one device, and no meta tensor beside real ones.

    The one device check of every op (:func:`~mpnb.core.ops._library.define` runs it in the
    op's fake and wherever the per-tensor checks run). A call holding a meta tensor
    dispatches to the fake, which writes nothing: refused unless every tensor is on meta
    (shape propagation, as torch's own ops allow). Under ``FakeTensorMode`` the tensors
    report their real device and pass. Single tensors (a flag, a scale) may sit on another
    real device; each op's check says where it needs them.
    """
    singles, listed = [], []
    for value in args:
        if isinstance(value, torch.Tensor):
            singles.append(value.device)
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            listed.extend(map(_DEVICE, value))
    devices = set(listed)
    kinds = {d.type for d in singles} | {d.type for d in devices}
    if len(devices) <= 1 and not ("meta" in kinds and len(kinds) > 1):
        return  # the passing case, without a name built; else find and name the culprit
    _name_device_problem(args)


def _name_device_problem(args) -> None:
    op = getattr(args, "op_name", type(args).__name__)
    found = list(_tensors_of(args))
    meta = next(((w, t.device) for w, t, _ in found if t.device.type == "meta"), None)
    real = next(((w, t.device) for w, t, _ in found if t.device.type != "meta"), None)
    if meta is not None and real is not None:
        raise ValueError(
            f"{op}: {meta[0]} is on meta but {real[0]} is on {real[1]}: a meta tensor holds "
            "no data, so the op would write nothing (and report nothing). Materialize it "
            f"first (module.to_empty(device={str(real[1])!r}) then initialize or load the "
            "weights), or put every tensor on one device."
        )
    listed = [(w, t.device) for w, t, in_list in found if in_list]
    for where, dev in listed[1:]:
        if dev != listed[0][1]:
            raise ValueError(
                f"{op}: {where} is on {dev} but {listed[0][0]} is on {listed[0][1]}; put "
                f"every tensor of the lists on one device (.to({str(listed[0][1])!r}))."
            )


def check_one(op: str, name: str, t: torch.Tensor | None) -> None:
    """Raise unless ``t`` (a flag, a scale; None allowed) holds exactly one element."""
    if t is not None and t.numel() != 1:
        raise ValueError(
            f"{op}: {name} must hold one value, got {t.numel()}; pass a one-element tensor."
        )


def check_float(op: str, x: torch.Tensor, what: str = "input") -> None:
    """Raise ``TypeError`` unless ``x`` is a tensor of a supported floating dtype."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(x).__name__}.")
    if x.dtype not in SUPPORTED:
        raise TypeError(
            f"{op}: {what} is {x.dtype}; supported dtypes are float32, float16, bfloat16 and "
            f"float64 (convert with .float() or .to(torch.bfloat16))."
        )


def norm_rows(op: str, x: torch.Tensor, shape: Sequence[int]) -> tuple[int, int]:
    """``(rows, cols)`` of ``x`` normalized over its trailing ``shape``; raise on a mismatch."""
    shape = tuple(int(s) for s in shape)
    k = len(shape)
    if k == 0 or x.dim() < k or tuple(x.shape[x.dim() - k :]) != shape:
        raise ValueError(
            f"{op}: input of shape {tuple(x.shape)} does not end with normalized_shape {shape}; "
            "normalized_shape must be the input's trailing dims (e.g. [hidden] for (batch, "
            "seq, hidden))."
        )
    cols = 1
    for s in shape:
        cols *= s
    return (x.numel() // cols if cols else 0), cols


def check_param(op: str, x: torch.Tensor, p: torch.Tensor | None, cols: int, what: str) -> None:
    """Raise unless the affine parameter ``p`` (or None) fits an input normalized over ``cols``."""
    if p is None:
        return
    if p.device != x.device:
        raise ValueError(
            f"{op}: {what} is on {p.device} but the input is on {x.device}; move both "
            "to one device."
        )
    if p.numel() != cols:
        raise ValueError(
            f"{op}: {what} has {p.numel()} elements but normalized_shape holds {cols}; "
            f"pass a {what} of shape normalized_shape."
        )
    mixed_ok = p.dtype == torch.float32 and x.dtype != torch.float64
    if p.dtype != x.dtype and not mixed_ok:
        raise TypeError(
            f"{op}: {what} is {p.dtype} but the input is {x.dtype}; use the input's "
            "dtype, or float32 weights with a half input (the mixed layers)."
        )


# ---- helpers of the references --------------------------------------------------------------


def raise_flag_if(flag: torch.Tensor, bad: torch.Tensor) -> None:
    """``flag = max(flag, bad)`` on the flag's device (no host sync where both share one);
    flags are never cleared."""
    bad = bad.to(device=flag.device, dtype=flag.dtype).reshape(flag.shape)
    flag.copy_(torch.maximum(flag, bad))


def any_nonfinite(tensors: Tensors, device: torch.device) -> torch.Tensor:
    """A boolean 0-dim tensor: does any of ``tensors`` hold inf or NaN (no host sync)."""
    if not tensors:
        return torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack([~torch.isfinite(t).all() for t in tensors]).any()


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a kernel computes in: fp64 for fp64 data, fp32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
