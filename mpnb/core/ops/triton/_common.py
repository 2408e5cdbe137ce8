"""Helpers shared by the Triton kernels: dtype-exact loads and stores, scalars, launching.

Conversions are written with integer bit operations where Triton's interpreter
(``TRITON_INTERPRET=1``, the CPU test path) differs from a GPU: the interpreter converts
fp32 to bf16 by truncation (a GPU rounds to nearest even) and flushes bf16 subnormals when
widening them, so :func:`to_acc` and :func:`from_acc` do both conversions by hand. The same
code runs on both, so what the CPU tests check is what a GPU runs.

Scalar arguments: Triton passes a Python ``float`` as fp32 on a GPU but the interpreter keeps
it a Python float (double). Kernels therefore receive fp32 values already rounded on the host
(:func:`f32`), and values needed in fp64 (the bias corrections, fp64 data) as an fp32 pair
``hi + lo`` (:func:`split64`, joined in the kernel by :func:`join64`) good to 48 bits.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

__all__ = [
    "TL_DTYPES",
    "acc_of",
    "f32",
    "f32s",
    "f32s_struct",
    "split64",
    "launch",
    "launch_kw",
    "counting_launches",
    "warps",
    "next_pow2",
    "cdiv",
    "to_acc",
    "from_acc",
    "join64",
    "raise_flag",
    "nonfinite",
    "div",
    "sqrt",
    "flag_view",
]

#: torch dtype -> Triton dtype, for the floating dtypes the kernels read and write.
TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float64: tl.float64,
}

_F32 = struct.Struct("f")
# Tensor types that hold real memory: any other subclass (fake, functional) means a tracer.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def acc_of(dtype: torch.dtype):
    """The Triton dtype a kernel computes in: fp64 for fp64 data, fp32 otherwise."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def f32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (what a GPU kernel receives for a float)."""
    return _F32.unpack(_F32.pack(float(x)))[0]


def f32s(*xs: float) -> tuple[float, ...]:
    """:func:`f32` of each of ``xs``, in one ``struct`` round trip (what a launch passes its
    kernel: its floats rounded together cost about one :func:`f32` call)."""
    s = f32s_struct(len(xs))
    return s.unpack(s.pack(*map(float, xs)))


def f32s_struct(n: int) -> struct.Struct:
    """The ``struct.Struct`` of :func:`f32s` for ``n`` values (packing rounds each to fp32), for
    code that binds it once (:class:`~mpnb.core.ops.triton._optim.OpKernel`'s builder)."""
    s = _F32S.get(n)
    if s is None:
        s = _F32S[n] = struct.Struct(f"{n}f")
    return s


_F32S: dict[int, struct.Struct] = {}  #: f32s' formats, by the number of values


def split64(x: float) -> tuple[float, float]:
    """``(hi, lo)``, two fp32 values with ``hi + lo == x`` to about 48 bits (for fp64 math)."""
    hi = f32(x)
    return hi, f32(float(x) - hi)


def next_pow2(n: int) -> int:
    """The smallest power of two at least ``max(n, 1)`` (``triton.next_power_of_2``'s value,
    in integer arithmetic: Triton's host-side call costs about 2 us, a launch's whole budget
    of host work for a small kernel)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (``triton.cdiv``'s value, in integer arithmetic: see
    :func:`next_pow2`)."""
    return -(-a // b)


def flag_view(flag: torch.Tensor) -> torch.Tensor:
    """A one-element flag as a tensor the kernels can read and write (bool seen as uint8)."""
    return flag.view(torch.uint8) if flag.dtype == torch.bool else flag


def warps(elements: int) -> int:
    """Warps for a program that holds ``elements`` values per tensor (about 16-32 per thread)."""
    return 4 if elements <= 2048 else 8 if elements <= 8192 else 16


#: the open :func:`counting_launches` blocks, innermost last (each a list of kernel names)
_COUNTING: list[list[str]] = []


class counting_launches:  # noqa: N801 - used as a function: ``with counting_launches():``
    """Inside the block, :func:`launch` runs nothing and records each kernel's name in the
    yielded list: what a launcher does on the host (its checks, its chunk table, its argument
    lists) can then be timed and its launches counted on any machine, without a GPU. (A class,
    not a generator: entering and leaving the block costs the timed call next to nothing.)

    Example::

        >>> with counting_launches() as names:
        ...     launcher("multi_tensor_scale")(flag, grads, masters, 0.5)
        >>> names
        ['_scale_kernel']
    """

    __slots__ = ("names",)

    def __init__(self) -> None:
        self.names: list[str] = []

    def __enter__(self) -> list[str]:
        _COUNTING.append(self.names)
        return self.names

    def __exit__(self, *exc) -> None:
        # by identity (list.remove compares by value: an equal outer list would go instead)
        if _COUNTING[-1] is self.names:
            del _COUNTING[-1]
        else:  # blocks left out of order
            del _COUNTING[next(k for k, n in enumerate(_COUNTING) if n is self.names)]


def launch(kernel, grid, *args, **kwargs) -> None:
    """Launch ``kernel[grid](*args, **kwargs)``; kernels are launched by keyword, their
    parameters named as the op's arguments (``args._asdict()``) wherever they are one.

    Through :func:`torch.library.wrap_triton` whenever a tracer could be watching (a
    ``torch.compile`` trace, fake or functional tensors); directly for plain tensors in eager
    mode, as ``torch.library.triton_op`` does for its eager calls (the higher-order-op
    dispatch costs far more than a small kernel).

    Eager launches compile with ``enable_fp_fusion=False``: no multiply-add is contracted
    into an FMA, so a GPU rounds each operation as the CPU references (and the interpreter
    tests) do; Triton 3.9 contracts by default and 3.10 will not. The traced launch leaves
    that choice to the compiler of the graph.
    """
    launch_kw(kernel, grid, args, kwargs)


def launch_kw(kernel, grid, args: tuple, kwargs: dict) -> None:
    """:func:`launch` with the arguments as a tuple and a dict (``kwargs`` is consumed: the
    launch adds its own keyword to it). A launcher that builds its keywords as one dict
    (:class:`~mpnb.core.ops.triton._optim.OpKernel`) passes it as it is, not spread into a
    call and gathered again."""
    if _COUNTING:
        fn = getattr(kernel, "fn", kernel)  # a JITFunction wraps the Python function
        name = getattr(fn, "__name__", None)
        _COUNTING[-1].append(repr(kernel) if name is None else name)
        return
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    traced = torch.compiler.is_compiling() or (
        first is not None and type(first) is not torch.Tensor
    )
    if traced:
        torch.library.wrap_triton(kernel)[grid](*args, **kwargs)
    else:
        kwargs["enable_fp_fusion"] = False
        kernel[grid](*args, **kwargs)


# ---- device helpers (called from the kernels) ---------------------------------------------


@triton.jit
def to_acc(x, ACC: tl.constexpr):
    """Widen loaded values to ``ACC`` exactly (bf16 by its bits: exact for subnormals too)."""
    if x.dtype == tl.bfloat16:
        y = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        out = y.to(ACC)
    else:
        out = x.to(ACC)
    return out


@triton.jit
def from_acc(y, DT: tl.constexpr):
    """Round ``y`` to the storage dtype ``DT`` to nearest even (bf16 by its bits)."""
    if DT == tl.bfloat16:
        f = y.to(tl.float32)
        bits = f.to(tl.uint32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(f != f, 0x7FC0, r)
        out = r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = y.to(DT)
    return out


@triton.jit
def join64(hi, lo):
    """``hi + lo`` in fp64: the value :func:`split64` split on the host."""
    return tl.cast(hi, tl.float64) + tl.cast(lo, tl.float64)


@triton.jit
def div(a, b):
    """``a / b`` rounded to nearest (a GPU's default fp32 division is approximate)."""
    if a.dtype == tl.float64:
        out = a / b
    else:
        out = tl.div_rn(a, b)
    return out


@triton.jit
def sqrt(x):
    """``sqrt(x)`` rounded to nearest (a GPU's default fp32 square root is approximate)."""
    if x.dtype == tl.float64:
        out = tl.sqrt(x)
    else:
        out = tl.sqrt_rn(x)
    return out


@triton.jit
def nonfinite(x):
    """1 where ``x`` is inf or NaN, else 0 (int32)."""
    return ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)


@triton.jit
def raise_flag(flag_ptr, bad):
    """Set the one-element flag to 1 when ``bad`` (a scalar) is nonzero; never lower it.

    Every program that sees a bad value stores the same 1, so the race is harmless and no
    atomics are needed (any flag dtype works).
    """
    cur = tl.load(flag_ptr)
    one = tl.full((), 1, flag_ptr.dtype.element_ty)
    tl.store(flag_ptr, one, mask=(bad != 0) & (cur < one))
