"""The timed GEMM probe behind :func:`mpnb.core.hardware.dtype_support`.

It times one small square GEMM in float32 and in each dtype asked about, on the device asked
about, at one thread (the process's thread count is restored afterwards, also when a GEMM
raises), after one warm-up call that absorbs JIT compilation and library initialisation.
Each timing is the fastest of a few runs: a loaded machine only ever makes a run slower.

Why not ``torch.utils.benchmark.Timer``: importing ``torch.utils.benchmark`` alone takes
longer than the whole probe (0.2-0.6 s against a few ms), and its ``timeit`` sets the thread
count around every call, which makes oneDNN rebuild its kernels each time. The clock is the
same as its ``timer`` (``time.perf_counter``, with ``torch.cuda.synchronize`` on CUDA).

The work is capped: a dtype whose first timed call is already decisively slow (emulated half
GEMMs run 20-400x slower than float32) is not timed again, and the FP8 probe on a CPU starts
at 16x16 because ``torch._scaled_mm`` there can take half a second at 128x128.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from mpnb.core.number_formats import format_of

__all__ = ["GemmTiming", "probe_sizes", "time_gemms"]

#: a timed run repeats the GEMM until it lasts this long (seconds); the fastest of _REPEATS
_MIN_RUN_S = 1e-4
_REPEATS = 3


@dataclass(frozen=True)
class GemmTiming:
    """One probe size's measurement: seconds per ``n x n`` GEMM in float32 and in the dtype."""

    n: int
    fp32_s: float
    dtype_s: float

    @property
    def speed_vs_fp32(self) -> float:
        """float32's time over the dtype's: above 1 the dtype is faster."""
        return self.fp32_s / self.dtype_s


def probe_sizes(device_type: str, dtype: str) -> tuple[int, ...]:
    """The GEMM sizes tried in turn (a later size only when the earlier one was not decisive).

    128 on a CPU: large enough that a native half GEMM is not lost in call overhead (at 64 a
    native bf16 GEMM measured 3-4x slower than float32), small enough that an emulated one
    costs a few ms (each format's ``probe.cpu_sizes`` in :mod:`mpnb.core.number_formats`:
    FP8 tries 16 first). 2048 on CUDA: below that, launch overhead hides the dtype.
    """
    if device_type == "cuda":
        return (2048,)
    return _format(dtype).probe.cpu_sizes


def _format(dtype: str):
    return format_of(dtype)


def _scaled(dtype: str) -> bool:
    """True where ``dtype``'s format is probed through ``torch._scaled_mm`` (FP8)."""
    probe = _format(dtype).probe
    return probe is not None and probe.op == "scaled_mm"


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    prior = torch.get_num_threads()
    if prior != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if prior != 1:
            torch.set_num_threads(prior)


def _gemm(dtype: str, n: int, device: torch.device) -> Callable[[], object]:
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device)
    b = torch.randn(n, n, generator=g).to(device)
    if _scaled(dtype):
        fp8 = getattr(torch, dtype)
        a8, one = a.to(fp8), torch.ones((), device=device)
        b8 = b.to(fp8).t().contiguous().t()  # column-major: what torch._scaled_mm needs on CUDA
        out = torch.bfloat16 if device.type == "cuda" else torch.float32
        return lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=out)
    if _format(dtype).low_precision:
        a, b = a.to(getattr(torch, dtype)), b.to(getattr(torch, dtype))
    return lambda: torch.mm(a, b)


def _seconds(fn: Callable[[], object], number: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(number):
        fn()
    sync()
    return (time.perf_counter() - start) / number


def _first_and_fastest(fn, device, settled_above: float = math.inf) -> float:
    """Seconds per call: the faster of two single calls when both took over ``settled_above``
    (one call preempted on a busy machine must not settle it), else the fastest of a few
    runs."""
    fn()  # warm-up: JIT compilation, library and primitive initialisation
    first = _seconds(fn, 1, device)
    if first > settled_above:
        first = min(first, _seconds(fn, 1, device))
        if first > settled_above:
            return first
    number = max(1, min(1000, int(_MIN_RUN_S / max(first, 1e-9))))
    return min([first, *(_seconds(fn, number, device) for _ in range(_REPEATS))])


def time_gemms(
    dtypes: Sequence[str],
    device: str | torch.device = "cpu",
    decisive_below: Mapping[str, float] | None = None,
) -> dict[str, list[GemmTiming] | Exception]:
    """Time ``n x n`` GEMMs in float32 and in each of ``dtypes`` at :func:`probe_sizes`.

    Args:
        dtypes: torch dtype names: ``"bfloat16"``, ``"float16"``, ``"float8_e4m3fn"``.
        device: where to run them.
        decisive_below: per dtype, a speed ratio (float32's time over the dtype's) below
            which one timed call settles the answer: that dtype is not timed again and no
            larger size is tried.

    Returns:
        Per dtype, one :class:`GemmTiming` per size tried (the last is the answer), or the
        exception PyTorch raised when it could not run the GEMM in that dtype here.
    """
    dev = torch.device(device)
    stop = dict(decisive_below or {})
    fp32: dict[int, float] = {}
    out: dict[str, list[GemmTiming] | Exception] = {}
    with _one_thread():
        for dtype in dtypes:
            timings: list[GemmTiming] = []
            try:
                for n in probe_sizes(dev.type, dtype):
                    if n not in fp32:
                        fp32[n] = _first_and_fastest(_gemm("float32", n, dev), dev)
                    below = stop.get(dtype, 0.0)
                    settled = fp32[n] / below if below > 0 else math.inf
                    t = _first_and_fastest(_gemm(dtype, n, dev), dev, settled)
                    timings.append(GemmTiming(n, fp32[n], t))
                    if t > settled:
                        break
                out[dtype] = timings
            except Exception as exc:  # noqa: BLE001 - PyTorch cannot run it: that is the answer
                out[dtype] = exc
    return out
