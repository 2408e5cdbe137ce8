"""What the Triton optimizer steps share: their list checks, the step counter, fp64 powers.

Conventions are those of the optimizer ops (:mod:`mpnb.core.ops.adam` and its siblings):
``masters`` empty or one fp32 tensor per param (the weight updated; ``params`` then receive
its rounded copy in the same pass), ``steps`` one one-element fp32 tensor per param,
``inv_scale`` multiplied into the grads in fp32, and ``found_inf``: when nonzero on entry
nothing is written, step counts included. The flag is read on the device (no host sync):
every store is masked by it and :func:`advance_steps` adds ``found_inf == 0`` to each step
after the update.

The step kernels are launched by keyword from the op's arguments (:class:`OpKernel`): a
kernel's scalar parameters are named after them, so an argument added to an op reaches the
kernel that declares it with no change to its launcher.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from mpnb.core.ops._library import op_info
from mpnb.core.ops.triton._checks import ListIds, guard_lists
from mpnb.core.ops.triton._chunks import BLOCK, WARPS, ChunkTable
from mpnb.core.ops.triton._common import (
    cdiv,
    f32s_struct,
    flag_view,
    from_acc,
    launch,
    launch_kw,
    to_acc,
)
from mpnb.core.ops.triton._rounding import KAHAN, NEAREST, store_rounded

__all__ = [
    "OPT_DTYPES",
    "OpKernel",
    "guard_step",
    "advance_steps",
    "pow64",
    "bias_corrections",
    "step_of",
    "not_found",
    "load_scale",
    "learning_rate",
    "load_grad",
    "load_weight",
    "store_weight",
    "store_step",
]

OPT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_STEP_BLOCK = 256


def guard_step(
    args, *states: str, masters: str | None = "masters", rounding: bool = False
) -> ListIds | None:
    """The per-tensor checks of an optimizer step (:func:`mpnb.core.ops._optim.check_step`'s,
    and the momentum's and rounding's where the op has them) in one pass, through
    :func:`~mpnb.core.ops.triton._checks.guard_lists`: ``params``, ``grads``, the ``states``,
    the masters, the momentum buffers (with momentum) and the compensations paired tensor by
    tensor; ``steps`` one fp32 value each; bf16 compensations and params below 2^32 elements
    with a ``rounding``. Returns the lists' ids for the chunk table."""
    has_momentum = getattr(args, "momentum", 0) != 0
    key = (states, masters, rounding, has_momentum)
    spec = _STEP_GUARDS.get(key)
    if spec is None:
        data = ["params", "grads", *states]
        if masters:
            data.append(masters)
        if has_momentum:
            data.append("momentum_buffers")
        dtypes = [("steps", torch.float32)]
        if rounding:
            data.append("compensations")
            dtypes.append(("compensations", torch.bfloat16))
        below = ("params",) if rounding else ()
        spec = _STEP_GUARDS[key] = (tuple(data), ("steps",), below, tuple(dtypes))
    return guard_lists(args, *spec)


#: guard_step's conditions -> guard_lists' arguments (data, singles, below_2e32, dtypes)
_STEP_GUARDS: dict[tuple, tuple] = {}


@triton.jit
def pow64(base, n):
    """``base ** n`` in fp64 for an integer ``n`` in [0, 2**31), by repeated squaring."""
    acc = tl.full((), 1.0, tl.float64)
    b = base
    e = n
    for _ in range(31):
        acc = tl.where((e & 1) != 0, acc * b, acc)
        b = b * b
        e = e >> 1
    return acc


@triton.jit
def bias_corrections(step, beta1, beta2):
    """``(1 - beta1**step, 1 - beta2**step)`` in fp64 (``step`` a whole fp32 count)."""
    n = step.to(tl.int32)
    return 1.0 - pow64(beta1, n), 1.0 - pow64(beta2, n)


@triton.jit
def step_of(table, t, col, carrier, ROW: tl.constexpr):
    """The step count this update uses: the stored count plus one."""
    addr = tl.load(table + t * ROW + col)
    return tl.load(addr.to(tl.pointer_type(carrier.dtype.element_ty))) + 1.0


@triton.jit
def not_found(found_ptr, HAS_FOUND: tl.constexpr):
    """1 unless the caller's overflow flag is set, then 0 (int32: multiply a count by it).

    A flagged step then runs no loop at all: nothing is read or written.
    """
    if HAS_FOUND:
        ok = (to_acc(tl.load(found_ptr), tl.float32) == 0.0).to(tl.int32)
    else:
        ok = tl.full((), 1, tl.int32)
    return ok


@triton.jit
def load_scale(inv_ptr, HAS_INV: tl.constexpr):
    """The grads' unscale factor ``inv_scale`` in fp32 (1 without one)."""
    if HAS_INV:
        inv = to_acc(tl.load(inv_ptr), tl.float32)
    else:
        inv = tl.full((), 1.0, tl.float32)
    return inv


@triton.jit
def learning_rate(lr_ptr, lr_hi, lr_lo, wd_hi, wd_lo, neg_lr, decay, HAS_LR_T: tl.constexpr):
    """``(lr, -lr, 1 - lr * weight_decay)``: lr in fp64, the other two in fp32, rounded once.

    From the host's numbers (``lr`` split in two fp32 halves, ``neg_lr`` and ``decay`` rounded
    on the host), or, with ``HAS_LR_T``, from the fp32 learning rate at ``lr_ptr`` (the op's
    ``lr_tensor``: a captured step reads whatever an LR schedule last wrote there).
    """
    if HAS_LR_T:
        lr = tl.load(lr_ptr).to(tl.float64)
        out_neg = (-lr).to(tl.float32)
        out_decay = (1.0 - lr * (tl.cast(wd_hi, tl.float64) + tl.cast(wd_lo, tl.float64))).to(
            tl.float32
        )
    else:
        lr = tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)
        out_neg = tl.cast(neg_lr, tl.float32)
        out_decay = tl.cast(decay, tl.float32)
    return lr, out_neg, out_decay


@triton.jit
def load_grad(g_ptr, offs, mask, inv, HAS_INV: tl.constexpr):
    """Grads widened to fp32 and unscaled."""
    g = to_acc(tl.load(g_ptr + offs, mask=mask, other=0.0), tl.float32)
    if HAS_INV:
        g = g * inv
    return g


@triton.jit
def load_weight(p_ptr, w_ptr, offs, mask, HAS_MASTER: tl.constexpr):
    """The fp32 weight: the master, or the param widened."""
    if HAS_MASTER:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    else:
        w = to_acc(tl.load(p_ptr + offs, mask=mask, other=0.0), tl.float32)
    return w


@triton.jit
def store_weight(p_ptr, w_ptr, offs, w, mask, HAS_MASTER: tl.constexpr):
    """Write the updated fp32 weight: into the master, and rounded into the param."""
    if HAS_MASTER:
        tl.store(w_ptr + offs, w, mask=mask)
    tl.store(p_ptr + offs, from_acc(w, p_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_step(p_ptr, w_ptr, offs, x, mask, key, HAS_MASTERS: tl.constexpr, ROUNDING: tl.constexpr):
    """Write the new fp32 weights ``x``: with ``ROUNDING`` :data:`~._rounding.NEAREST` as
    :func:`store_weight` (``w_ptr``: the masters), else rounded into the bf16 params by
    :func:`~._rounding.store_rounded` (``w_ptr``: Kahan's compensations)."""
    if ROUNDING == NEAREST:
        store_weight(p_ptr, w_ptr, offs, x, mask, HAS_MASTERS)
    else:
        store_rounded(p_ptr, w_ptr, offs, x, mask, key, ROUNDING == KAHAN)


@triton.jit
def _advance_kernel(
    table,
    n_tensors,
    found_ptr,
    s0,
    COL: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = t < n_tensors * not_found(found_ptr, HAS_FOUND)
    addr = tl.load(table + t.to(tl.int64) * ROW + COL, mask=m, other=0)
    ptr = addr.to(tl.pointer_type(s0.dtype.element_ty))
    tl.store(ptr, tl.load(ptr, mask=m) + 1.0, mask=m)


def advance_steps(tab: ChunkTable, col: int, steps, found_inf) -> None:
    """``steps[i] += 1`` for every tensor (in table column ``col``) unless ``found_inf``."""
    if not tab.n_tensors:
        return
    launch(
        _advance_kernel,
        (cdiv(tab.n_tensors, _STEP_BLOCK),),
        tab.table,
        tab.n_tensors,
        tab.table if found_inf is None else flag_view(found_inf),
        steps[0],
        COL=col,
        HAS_FOUND=found_inf is not None,
        ROW=tab.row,
        BLOCK=_STEP_BLOCK,
    )


# ---- launching by keyword from the op's arguments ------------------------------------------


def _kinds(op_name: str) -> dict[str, str]:
    """Each argument of op ``op_name`` -> its schema type's kind (``"FloatType"``, ...; an
    optional tensor ``"Tensor?"``)."""
    schema = torch._C.parse_schema(op_info(op_name).schema)
    return {
        a.name: "Tensor?" if str(a.type) == "Optional[Tensor]" else a.type.kind()
        for a in schema.arguments
    }


def _rule(name: str, index: dict[str, int], kinds: dict[str, str]) -> str | None:
    """The Python expression of kernel parameter ``name`` in the op's arguments ``a`` (the
    named tuple) and the chunk table ``tab``, or None when no rule gives it. Float
    argument ``i`` is rounded once: ``x<i>``, ``f32(a[i])``, bound by :func:`_builder`."""
    if name in index:
        i, kind = index[name], kinds.get(name)
        return {
            "FloatType": f"x{i}",
            "IntType": f"a[{i}]",
            "BoolType": f"a[{i}]",
            "TensorType": f"a[{i}]",
            "Tensor?": f"(tab.table if a[{i}] is None else flag_view(a[{i}]))",
        }.get(kind)
    if name.isupper():
        low = name.lower()
        if low.startswith("has_") and low[4:] in index:
            i = index[low[4:]]
            return {
                "Tensor?": f"a[{i}] is not None",
                "ListType": f"len(a[{i}]) > 0",
                "FloatType": f"a[{i}] != 0",
            }.get(kinds.get(low[4:]))
        if low in index and kinds.get(low) == "BoolType":
            return f"bool(a[{index[low]}])"
        return None
    for prefix, form in (("neg_", "-x{i}"), ("one_m_", "f32(1.0 - a[{i}])")):
        arg = name.removeprefix(prefix)
        if arg != name and kinds.get(arg) == "FloatType":
            return form.format(i=index[arg])  # -f32(x) is f32(-x) exactly
    arg, _, part = name.rpartition("_")
    if part in ("hi", "lo") and kinds.get(arg) == "FloatType":
        i = index[arg]
        return f"x{i}" if part == "hi" else f"f32(a[{i}] - x{i})"  # split64's halves
    return None


#: the chunk table's keywords of every launch, as expressions of the table ``tab``
_TABLE_KWARGS = dict(
    table="tab.table", n_tensors="tab.n_tensors", ROW="tab.row", CHUNK="tab.chunk", BLOCK="BLOCK"
)


def _builder(names: list[str], exprs: list[str]) -> Callable:
    """``build(a, kw, tab) -> {name: value}``: the launcher's keywords ``kw``, the chunk
    table's, and the parameters ``names`` by their ``exprs`` (:func:`_rule`), written out as
    source once (as ``dataclasses`` writes ``__init__``): one dict display, the float arguments
    rounded once, together (:func:`~._common.f32s`)."""
    floats = sorted({int(i) for e in exprs for i in re.findall(r"\bx(\d+)\b", e)})
    rounded: list[str] = []  # the other roundings (1 - x, x's low half), as y<k>

    def name(m: re.Match) -> str:
        rounded.append(m.group(1))
        return f"y{len(rounded) - 1}"

    exprs = [re.sub(r"\bf32\(([^()]*)\)", name, e) for e in exprs]
    lines = ["def build(a, kw, tab):"]
    scope = {"flag_view": flag_view, "BLOCK": BLOCK}
    for k, (targets, values) in enumerate(
        (
            ([f"x{i}" for i in floats], [f"a[{i}]" for i in floats]),
            ([f"y{j}" for j in range(len(rounded))], rounded),
        )
    ):
        if values:  # rounded together, as f32() rounds each (f32s' struct, bound here)
            scope[f"_s{k}"] = f32s_struct(len(values))
            floats_ = ", ".join(f"float({v})" for v in values)
            lines.append(
                f"    {''.join(t + ', ' for t in targets)}= _s{k}.unpack(_s{k}.pack({floats_}))"
            )
    pairs = [*_TABLE_KWARGS.items(), *zip(names, exprs, strict=True)]
    items = ", ".join(f"{n!r}: {e}" for n, e in pairs)
    lines.append(f"    return {{**kw, {items}}}")
    exec("\n".join(lines), scope)  # noqa: S102 - source made of parameter names and indices
    return scope["build"]


class OpKernel:
    """A chunk-table kernel (:mod:`._chunks`) launched by keyword from an op's arguments
    (``args._asdict()``'s names), so that an argument added to the op needs no change where the
    kernel is launched.

    Each parameter of the kernel takes, the first that applies:

    * what the launcher gives by keyword (the lists' carrier tensors, values derived from
      several arguments), and the chunk table's ``table``, ``n_tensors``, ``ROW``, ``CHUNK``
      and ``BLOCK``;
    * the op's argument of that name: a float rounded to fp32 (:func:`~._common.f32`), an int,
      a bool or a tensor as it is, an optional tensor as itself (a bool flag seen as uint8,
      :func:`~._common.flag_view`) or, when None, the chunk table (``table``: a pointer the
      kernel never reads);
    * from a float argument ``x``: ``x_hi`` and ``x_lo``, its two fp32 halves for fp64 math
      (:func:`~._common.split64`), ``neg_x`` (``-x``) and ``one_m_x`` (``1 - x``) in fp32;
    * ``X``, the argument's name in capitals (a constexpr): a bool argument; ``HAS_X``: an
      optional tensor given, a list not empty, a float not zero;
    * the kernel's default, where the op has no such argument (``MAXIMIZE: tl.constexpr =
      False`` serves an op without ``maximize``).

    Anything else is a ``TypeError`` when the launch is planned: a parameter that nothing
    supplies, a keyword that the kernel does not declare or that the op's arguments supply.
    The plan (which rule serves each parameter) is made once per op and set of keywords and
    kept here, as one function that builds the keywords (a launch pays for one dict).

    Example::

        >>> _ADAM = OpKernel(_adam_kernel)
        >>> _ADAM(ChunkTable.build(lists), args, p0=args.params[0], ...)
    """

    def __init__(self, kernel, num_warps: int = WARPS) -> None:
        self.kernel = kernel
        self.num_warps = num_warps
        fn = getattr(kernel, "fn", kernel)  # a JITFunction wraps the Python function
        self.name = fn.__name__
        params = inspect.signature(fn).parameters.values()
        self._optional = {p.name: p.default is not inspect.Parameter.empty for p in params}
        self._plans: dict[tuple, Callable] = {}

    def __call__(self, tab: ChunkTable, args, **given) -> None:
        """Launch the kernel, one program per chunk of ``tab``, for the op call ``args`` (its
        named tuple) with the launcher's keywords ``given`` and the table's (``table``,
        ``n_tensors``, ``ROW``, ``CHUNK``, ``BLOCK``)."""
        key = (type(args), *given)
        build = self._plans.get(key)
        if build is None:
            build = self._plans[key] = self._plan(type(args), given)
        kwargs = build(args, given, tab)
        kwargs["num_warps"] = self.num_warps
        launch_kw(self.kernel, (tab.n_chunks,), (), kwargs)

    def kwargs(self, args, tab: ChunkTable | None = None, **given) -> dict:
        """The keywords a launch for ``args`` on the chunk table ``tab`` with the launcher's
        ``given`` passes the kernel (what a test inspects; ``tab`` None: a table's fields
        stand in, ``table`` the string "table")."""
        if tab is None:
            tab = ChunkTable("table", 1, 1, 1)
        return self._plan(type(args), given)(args, given, tab)

    def _plan(self, Args: type, given: dict) -> Callable:
        op = Args.op_name
        unknown = [k for k in [*given, *_TABLE_KWARGS] if k not in self._optional]
        if unknown:
            raise TypeError(
                f"{op}: the launcher passes {unknown} to {self.name}, which has no such "
                f"parameter; declare it in the kernel's signature or stop passing it."
            )
        kinds = _kinds(op)
        index = {f: i for i, f in enumerate(Args._fields)}
        shadowed = [k for k in given if k in index or _rule(k, index, kinds) is not None]
        if shadowed:
            raise TypeError(
                f"{op}: the launcher passes {shadowed} to {self.name}, names that the op's "
                f"arguments supply (one source per parameter); leave them out of the launch, "
                f"or name the derived value otherwise."
            )
        names, exprs = [], []
        for name, optional in self._optional.items():
            if name in given or name in _TABLE_KWARGS:
                continue
            expr = _rule(name, index, kinds)
            if expr is not None:
                names.append(name)
                exprs.append(expr)
            elif name in index:
                raise TypeError(
                    f"{op}: argument {name!r} ({kinds.get(name)}) cannot reach {self.name} as "
                    f"it is; pass the value the kernel needs from the launcher ({name}=...)."
                )
            elif not optional:
                raise TypeError(
                    f"{op}: nothing supplies parameter {name!r} of {self.name}: it is no "
                    f"argument of the op (nor X_hi, X_lo, neg_X, one_m_X of a float one, X or "
                    f"HAS_X of one in capitals); rename it after the op's argument, give it "
                    f"a default in the kernel, or pass it from the launcher."
                )
        return _builder(names, exprs)
