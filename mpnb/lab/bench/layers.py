"""Fused layers (RMS norm, layer norm, scaled masked / causal softmax, RoPE) vs PyTorch.

Workloads: rows x columns (8192, 4096) and (32768, 1024), fp32 and bf16. For softmax the
rows are ``[b, np, sq]`` attention rows with ``sk`` columns: the padding-masked case uses a
``[b, 1, sq, sk]`` bool mask, the causal case square ``[batches, sq, sq]`` scores.

RoPE: ``[s, b, h, d]`` = (2048, 4, 32, 128), fp32 and bf16, one forward and one backward case
per layout (``[s, b, h, d]``, ``[b, s, h, d]``, ``[b, h, s, d]`` contiguous, and the strided
views ``q.transpose(1, 2)`` of a ``[b, s, h, d]`` tensor and ``[b, h, s, d]`` seen as ``[s, b,
h, d]``) against PyTorch's unfused expression on the same tensor.

Two kinds of case for the norms and softmax:

* ``fwd+bwd``: one forward and ``torch.autograd.grad`` (no ``.grad`` accumulation) through
  mpnb's module/function against PyTorch's: ``F.rms_norm``, ``F.layer_norm`` and the composite
  ``softmax(masked_fill(x * scale, mask, -10000))``. Targets from the issue.
* ``fwd`` and ``bwd`` (fp32 and bf16, 64 MiB and more): the kernel alone against PyTorch's
  (``aten`` backward where one exists). Softmax: the scaled, masked and causal forwards, the
  shared backward and its causal form.

Every kernel-alone case, and every RoPE case, also gives mpnb's row the least traffic the
kernel must make as ``bytes`` (each case's docstring or comment says what it counts: the
inputs read once, the output written once, per-row statistics and tables included), its
fraction of the same-run ``a += s*b`` bandwidth (target 0.7) and its roofline: the same
kernel timed on cache-resident slices of the workload (``InCache``: rows or positions that
fit in half of the L2 of each thread, at two slice sizes so the per-call cost cancels). A
kernel whose in-cache throughput is below 70% of that bandwidth is compute-bound at its
arithmetic on this CPU, and its row says so. Each such case also times ``x.clone()`` of a
tensor of the output's size (``floor: x.clone() (fresh output)``, its bytes read and written
once): every kernel that returns a fresh output pays what that copy pays beyond the add, the
OS zeroing each page of the new buffer on its first touch.

Every case also times ``torch.compile`` of mpnb's pure-PyTorch reference of the op (the
forward compiled, the backward through it), its compile time apart (``--no-compile`` skips it).

PyTorch's ops allocate each output through PyTorch's CPU allocator (glibc's malloc). mpnb's
layer kernels take an output of 16 MiB or more from their output cache
(``mpnb.core.ops.output_cache``): memory an earlier output of the same size gave back,
already backed, where glibc hands a fresh ``mmap`` to every allocation of 32 MiB or more and
the OS zeroes each page on the first write. That is part of what a user gets, so the plain run
keeps it. To compare the kernels alone, on the same memory, run the suite with
``MALLOC_MMAP_MAX_=0`` (glibc then reuses freed memory for PyTorch's outputs too) or with
``MPNB_CPU_OUTPUT_CACHE_MB=0`` (mpnb's outputs fresh too); the header reports both settings.
Fresh outputs of 16 MiB or more that mpnb does not cache get transparent huge pages advised
(``madvise(MADV_HUGEPAGE)``) so that they fault 2 MiB at a time; PyTorch's do the same only
with ``THP_MEM_ALLOC_ENABLE=1``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from mpnb.core import ops
from mpnb.core.ops.layer_norm import reference_layer_norm_bwd, reference_layer_norm_fwd
from mpnb.core.ops.rms_norm import reference_rms_norm_bwd, reference_rms_norm_fwd
from mpnb.core.ops.rotary import reference_rope
from mpnb.core.ops.softmax import (
    reference_scaled_masked_softmax_fwd,
    reference_scaled_softmax_bwd,
    reference_scaled_softmax_fwd,
    reference_scaled_upper_triang_masked_softmax_fwd,
)
from mpnb.lab.bench._harness import (
    RMW,
    Candidate,
    Case,
    InCache,
    Options,
    cache_resident,
    compiled,
)

__all__ = ["cases", "SHAPES", "ROPE_SHAPE"]

SHAPES = ((8192, 4096), (32768, 1024))
_TARGETS = {  # (op, dtype) -> fwd+bwd speed-up over PyTorch
    ("rms", torch.float32): 4.0,
    ("rms", torch.bfloat16): 7.0,
    ("ln", torch.float32): 1.0,
    ("ln", torch.bfloat16): 1.5,
    ("masked", torch.float32): 3.0,
    ("masked", torch.bfloat16): 5.0,
    ("causal", torch.float32): 3.0,
    ("causal", torch.bfloat16): 5.0,
}
_BW = 0.7  # every kernel alone: at least 70% of the same-run a += s*b bandwidth (issue 30)
_SCALE = 0.125


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _fwd_bwd(f, inputs, dy):
    def run():
        return torch.autograd.grad(f(*inputs), inputs, dy)

    return run


def _compiled(ref, f, inputs=(), dy=None, **kw) -> Candidate:
    """``torch.compile`` of ``f``, a call of the pure-PyTorch reference ``ref``; with ``dy``,
    ``f`` takes ``inputs`` and its forward and backward are timed (as :func:`_fwd_bwd`)."""
    call = (lambda fast: _fwd_bwd(fast, inputs, dy)) if dy is not None else None
    return compiled(f"torch.compile({ref.__name__})", f, call, **kw)


def _in_cache(make, size, most: int, square: bool) -> InCache | None:
    """The roofline of ``make``'s kernel: two cache-resident slices, ``size(k)`` bytes for a
    slice of ``k`` units. Rows (or positions): as many as half of each thread's L2 holds, and a
    quarter of them. ``square``: leading ``[S, S]`` blocks of the first matrix, S the largest
    multiple of 16 (at most ``most``) that fits, and ``S // 2``. None where the L2 size is not
    known."""
    if square:
        budget = cache_resident(1)  # bytes that stay in cache
        if budget is None:
            return None
        k = 16
        while k + 16 <= most and size(k + 16) <= budget:
            k += 16
        small = k // 2
    else:
        k = cache_resident(size(1), most=most)
        if k is None:
            return None
        small = max(1, k // 4)
    return InCache(make(k), size(k), make(small), size(small))


def _kernel_case(
    name: str,
    work: str,
    torch_cand: Candidate,
    mpnb_name: str,
    make,
    size,
    units: int,
    numel: int,
    compiled_cand: Candidate,
    bytes: int | None = None,
    fresh: torch.Tensor | None = None,
    square: bool = False,
) -> Case:
    """A kernel alone against PyTorch's, the same-run bandwidth and its in-cache roofline.

    Args:
        name, work: the case's name and workload.
        torch_cand: PyTorch's candidate (the baseline).
        mpnb_name: mpnb's candidate's name.
        make: ``make(k)`` is a zero-argument call of mpnb's kernel on the first ``k`` units
            (rows, positions) of the workload, ``make(None)`` on the whole workload.
        size: ``size(k)``, the least bytes the kernel moves (reads and writes) on a slice of
            ``k`` units; the whole workload moves ``size(units)`` unless ``bytes`` says
            otherwise.
        units: the units a slice may have at most.
        numel: the fp32 elements of the bandwidth baseline (the workload's element count).
        compiled_cand: the compiled reference.
        bytes: the whole workload's bytes, where they are not ``size(units)``.
        fresh: a tensor shaped as the kernel's output: its ``clone()`` (a fresh output of the
            same size, read and written once) is timed too, the floor a kernel that returns a
            fresh output sits on (the OS zeroes every page of it on first touch).
        square: the slices are square blocks (:func:`_in_cache`).
    """
    mpnb_cand = Candidate(
        mpnb_name,
        make(None),
        size(units) if bytes is None else bytes,
        RMW,
        bw_target=_BW,
        in_cache=_in_cache(make, size, units, square),
    )
    cands = [torch_cand, mpnb_cand, compiled_cand]
    if fresh is not None:
        cands.append(_fresh_floor(fresh))
    return Case(name, work, cands, bandwidth_numel=numel)


def _fresh_floor(t: torch.Tensor) -> Candidate:
    """``t.clone()``: a fresh output of ``t``'s size read and written once, with its bytes."""
    return Candidate("floor: x.clone() (fresh output)", t.clone, 2 * t.numel() * t.element_size())


# ---- the tables: one row per case, walked by _walk over one workload ``w`` ------------------
#
# ``w`` is a namespace of the workload's tensors and sizes. A table holds rows and steps: a
# step (a plain function of ``w``) adds the tensors the next rows need, so that each case is
# built, and timed, before the tensors of the cases after it exist.


@dataclass(frozen=True)
class _FwdBwd:
    """A ``fwd+bwd`` case: one forward and ``torch.autograd.grad`` through each side.

    Attributes:
        name: the case's name.
        torch: PyTorch's candidate, ``(name, f)``; ``f(w, *inputs)`` is its forward.
        mpnb: mpnb's candidate, ``(name, f)`` as ``torch``.
        compiled: ``(reference, f)``: ``f(w, *inputs)`` calls the pure-PyTorch reference,
            compiled.
        target: the op's key in :data:`_TARGETS` (mpnb's speed-up by dtype).
        inputs: the differentiable tensors of ``w``, by name, in the calls' order.
        dy: the output gradient, by name.
    """

    name: str
    torch: tuple[str, Callable]
    mpnb: tuple[str, Callable]
    compiled: tuple[Callable, Callable]
    target: str
    inputs: tuple[str, ...] = ("x",)
    dy: str = "dy"

    def case(self, w: SimpleNamespace, work: str) -> Case:
        """This row's case on workload ``w``."""
        inputs, dy = tuple(getattr(w, k) for k in self.inputs), getattr(w, self.dy)
        (torch_name, torch_f), (mpnb_name, mpnb_f), (ref, ref_f) = (
            self.torch,
            self.mpnb,
            self.compiled,
        )
        target = _TARGETS[(self.target, w.dtype)]
        return Case(
            self.name,
            work,
            [
                Candidate(torch_name, _fwd_bwd(partial(torch_f, w), inputs, dy)),
                Candidate(mpnb_name, _fwd_bwd(partial(mpnb_f, w), inputs, dy), target=target),
                _compiled(ref, partial(ref_f, w), inputs, dy),
            ],
        )


@dataclass(frozen=True)
class _Kernel:
    """A kernel alone (:func:`_kernel_case`): bytes, same-run bandwidth, in-cache roofline.

    Attributes:
        name: the case's name.
        torch: PyTorch's candidate, ``(name, f)``; ``f(w)`` is the call timed.
        mpnb: mpnb's candidate's name.
        make: ``make(w, k)``, a zero-argument call of mpnb's kernel on the first ``k`` units
            of ``w`` (``None``: all of them).
        compiled: ``(reference, f)``: ``f(w)`` calls the pure-PyTorch reference, compiled.
        size: ``size(w, k)``, the least bytes the kernel moves on ``k`` units (each input read
            once, each output written once).
        fresh: the tensor of ``w`` shaped as the output (the floor's ``clone()``), by name.
        units: how many units a slice may have at most, ``units(w)`` (rows by default).
        total: the whole workload's bytes, ``total(w)``, where not ``size(w, units(w))``.
        numel: the tensor of ``w`` whose element count sizes the bandwidth baseline.
        square: the slices are square blocks (:func:`_in_cache`).
    """

    name: str
    torch: tuple[str, Callable]
    mpnb: str
    make: Callable
    compiled: tuple[Callable, Callable]
    size: Callable
    fresh: str
    units: Callable = lambda w: w.rows
    total: Callable | None = None
    numel: str = "xd"
    square: bool = False

    def case(self, w: SimpleNamespace, work: str) -> Case:
        """This row's case on workload ``w``."""
        units, size = self.units(w), partial(self.size, w)
        total = size(units) if self.total is None else self.total(w)
        (torch_name, torch_f), (ref, ref_f) = self.torch, self.compiled
        return _kernel_case(
            self.name,
            work,
            Candidate(torch_name, partial(torch_f, w)),
            self.mpnb,
            partial(self.make, w),
            size,
            units,
            getattr(w, self.numel).numel(),
            _compiled(ref, partial(ref_f, w), bytes=total),
            bytes=None if self.total is None else total,
            fresh=getattr(w, self.fresh),
            square=self.square,
        )


def _walk(table: tuple, w: SimpleNamespace, work: str) -> Iterator[Case]:
    """Each row's case on ``w``, in order; a step (a function) runs when it is reached. Each
    case holds ``w`` as it stood when the case was built."""
    for row in table:
        if isinstance(row, (_FwdBwd, _Kernel)):
            yield row.case(SimpleNamespace(**vars(w)), work)
        else:
            row(w)


def _norm_stats(w: SimpleNamespace) -> None:
    """The kernels' inputs: detached tensors and the statistics each side's backward takes
    (PyTorch's from its own forward, in x's dtype for half x)."""
    w.xd, w.wd, w.bd = w.x.detach(), w.w.detach(), w.b.detach()
    _, w.mean, w.rstd = ops.layer_norm_fwd(w.xd, [w.cols], weight=w.wd, bias=w.bd, eps=1e-5)
    _, w.rrms = ops.rms_norm_fwd(w.xd, [w.cols], weight=w.wd, eps=1e-5)
    _, w.mean_t, w.rstd_t = torch.ops.aten.native_layer_norm(w.xd, [w.cols], w.wd, w.bd, 1e-5)
    w.yt = F.rms_norm(w.x, [w.cols], w.w, 1e-5)


# bytes per row: x read and y written (+ the fp32 mean and rstd written); the backward reads dy
# and x (+ mean and rstd) and writes dx
_NORMS = (
    _FwdBwd(
        "rms_norm fwd+bwd",
        ("torch F.rms_norm", lambda w, x, wt: F.rms_norm(x, [w.cols], wt, 1e-5)),
        (
            "mpnb FusedRMSNorm",
            lambda w, x, wt: ops.rms_norm_fwd(x, [w.cols], weight=wt, eps=1e-5)[0],
        ),
        (
            reference_rms_norm_fwd,
            lambda w, x, wt: reference_rms_norm_fwd(x, [w.cols], wt, eps=1e-5)[0],
        ),
        "rms",
        inputs=("x", "w"),
    ),
    _FwdBwd(
        "layer_norm fwd+bwd",
        ("torch F.layer_norm", lambda w, x, wt, b: F.layer_norm(x, [w.cols], wt, b, 1e-5)),
        (
            "mpnb FusedLayerNorm",
            lambda w, x, wt, b: ops.layer_norm_fwd(x, [w.cols], weight=wt, bias=b, eps=1e-5)[0],
        ),
        (
            reference_layer_norm_fwd,
            lambda w, x, wt, b: reference_layer_norm_fwd(x, [w.cols], wt, b, eps=1e-5)[0],
        ),
        "ln",
        inputs=("x", "w", "b"),
    ),
    _norm_stats,
    _Kernel(
        "layer_norm fwd",
        ("torch F.layer_norm", lambda w: F.layer_norm(w.xd, [w.cols], w.wd, w.bd, 1e-5)),
        "mpnb layer_norm_fwd",
        lambda w, k: (
            lambda: ops.layer_norm_fwd(w.xd[:k], [w.cols], weight=w.wd, bias=w.bd, eps=1e-5)
        ),
        (
            reference_layer_norm_fwd,
            lambda w: reference_layer_norm_fwd(w.xd, [w.cols], w.wd, w.bd, eps=1e-5),
        ),
        lambda w, k: k * (2 * w.cols * w.es + 8),
        fresh="xd",
    ),
    _Kernel(
        "layer_norm bwd",
        (
            "torch aten.native_layer_norm_backward",
            lambda w: torch.ops.aten.native_layer_norm_backward(
                w.dy, w.xd, [w.cols], w.mean_t, w.rstd_t, w.wd, w.bd, [True, True, True]
            ),
        ),
        "mpnb layer_norm_bwd",
        lambda w, k: (
            lambda: ops.layer_norm_bwd(
                w.dy[:k], w.xd[:k], w.mean[:k], w.rstd[:k], [w.cols], weight=w.wd, bias=w.bd
            )
        ),
        (
            reference_layer_norm_bwd,
            lambda w: reference_layer_norm_bwd(
                w.dy, w.xd, w.mean, w.rstd, [w.cols], weight=w.wd, bias=w.bd
            ),
        ),
        lambda w, k: k * (3 * w.cols * w.es + 8),
        fresh="dy",
    ),
    _Kernel(
        "rms_norm fwd",
        ("torch F.rms_norm", lambda w: F.rms_norm(w.xd, [w.cols], w.wd, 1e-5)),
        "mpnb rms_norm_fwd",
        lambda w, k: lambda: ops.rms_norm_fwd(w.xd[:k], [w.cols], weight=w.wd, eps=1e-5),
        (reference_rms_norm_fwd, lambda w: reference_rms_norm_fwd(w.xd, [w.cols], w.wd, eps=1e-5)),
        lambda w, k: k * (2 * w.cols * w.es + 4),
        fresh="xd",
    ),
    _Kernel(
        "rms_norm bwd",
        (
            "torch autograd of F.rms_norm",
            lambda w: torch.autograd.grad(w.yt, (w.x, w.w), w.dy, retain_graph=True),
        ),
        "mpnb rms_norm_bwd",
        lambda w, k: (
            lambda: ops.rms_norm_bwd(w.dy[:k], w.xd[:k], w.rrms[:k], [w.cols], weight=w.wd)
        ),
        (
            reference_rms_norm_bwd,
            lambda w: reference_rms_norm_bwd(w.dy, w.xd, w.rrms, [w.cols], weight=w.wd),
        ),
        lambda w, k: k * (3 * w.cols * w.es + 4),
        fresh="dy",
    ),
)


def _norm_cases(rows: int, cols: int, dtype: torch.dtype, work: str) -> Iterator[Case]:
    """RMS norm and layer norm on ``rows x cols``: :data:`_NORMS`."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g).to(dtype).requires_grad_(True)
    wt = (torch.rand(cols, generator=g) + 0.5).to(dtype).requires_grad_(True)
    b = torch.randn(cols, generator=g).to(dtype).requires_grad_(True)
    dy = torch.randn(rows, cols, generator=g).to(dtype)
    w = SimpleNamespace(x=x, w=wt, b=b, dy=dy, rows=rows, cols=cols, dtype=dtype)
    w.es = x.element_size()
    yield from _walk(_NORMS, w, work)


def _masked(x, mask):  # PyTorch's composite scaled, padding-masked softmax
    return torch.softmax((x * _SCALE).masked_fill(mask, -10000.0), -1)


def _causal(c, future):  # PyTorch's composite scaled causal softmax
    return torch.softmax((c * _SCALE).masked_fill(future, -10000.0), -1)


def _first(t, k, sk):  # the first k rows of [b, np, sq, sk] scores as [1, 1, k, sk]; None: all
    return t if k is None else t.reshape(-1, sk)[:k].view(1, 1, k, sk)


def _masked_kernel(w, k):
    # the [b, 1, sq, sk] mask is read once for all heads at full size (n // heads bytes); the
    # in-cache slices are rows of one head, each with its own mask row
    if k is None:
        return lambda: ops.scaled_masked_softmax_fwd(w.xd, w.mask, scale=_SCALE)
    xs, ms = w.xd[:1, :1, :k].contiguous(), w.mask[:1, :, :k].contiguous()
    return lambda: ops.scaled_masked_softmax_fwd(xs, ms, scale=_SCALE)


def _causal_fwd_kernel(w, s):
    cs = w.cd if s is None else w.cd[:1, :s, :s].contiguous()
    return lambda: ops.scaled_upper_triang_masked_softmax_fwd(cs, scale=_SCALE)


def _causal_bwd_kernel(w, s):
    if s is None:
        d, o = w.dyc, w.yc
    else:
        d, o = w.dyc[:1, :s, :s].contiguous(), w.yc[:1, :s, :s].contiguous()
    return lambda: ops.scaled_softmax_bwd(d, o, scale=_SCALE, upper_triang=True)


def _tri(s: int) -> int:
    return s * (s + 1) // 2


def _causal_scores(w: SimpleNamespace) -> None:
    """The causal cases' square ``[batches, sk, sk]`` scores and gradient, and the mask."""
    batches = max(1, w.rows // w.sk)
    w.c = torch.randn(batches, w.sk, w.sk, generator=w.g).to(w.dtype).requires_grad_(True)
    w.dyc = torch.randn(batches, w.sk, w.sk, generator=w.g).to(w.dtype)
    w.future = torch.ones(w.sk, w.sk, dtype=torch.bool).triu(1)


def _softmax_outputs(w: SimpleNamespace) -> None:
    """The kernels' inputs: detached scores and the forwards' outputs (the backwards' input)."""
    w.xd, w.cd = w.x.detach(), w.c.detach()
    w.y = ops.scaled_masked_softmax_fwd(w.xd, w.mask, scale=_SCALE)
    w.yc = ops.scaled_upper_triang_masked_softmax_fwd(w.cd, scale=_SCALE)


# The causal kernels: row i of each [sq, sq] matrix reads its first i + 1 scores (the forward)
# or gradients and outputs (the backward) and writes all sq outputs. The kernel takes square
# scores only, so its in-cache slices are the leading [S, S] blocks of the first matrix.
_SOFTMAX = (
    _FwdBwd(
        "scaled_masked_softmax fwd+bwd",
        ("torch x*s -> masked_fill -> softmax", lambda w, x: _masked(x, w.mask)),
        (
            "mpnb scaled_masked_softmax",
            lambda w, x: ops.scaled_masked_softmax_fwd(x, w.mask, scale=_SCALE),
        ),
        (
            reference_scaled_masked_softmax_fwd,
            lambda w, x: reference_scaled_masked_softmax_fwd(x, w.mask, scale=_SCALE),
        ),
        "masked",
    ),
    _causal_scores,
    _FwdBwd(
        "causal softmax fwd+bwd",
        ("torch x*s -> masked_fill(triu) -> softmax", lambda w, c: _causal(c, w.future)),
        (
            "mpnb scaled_upper_triang_masked_softmax",
            lambda w, c: ops.scaled_upper_triang_masked_softmax_fwd(c, scale=_SCALE),
        ),
        (
            reference_scaled_upper_triang_masked_softmax_fwd,
            lambda w, c: reference_scaled_upper_triang_masked_softmax_fwd(c, scale=_SCALE),
        ),
        "causal",
        inputs=("c",),
        dy="dyc",
    ),
    _softmax_outputs,
    _Kernel(
        "scaled_softmax fwd",
        ("torch softmax(x*s)", lambda w: torch.softmax(w.xd * _SCALE, -1)),
        "mpnb scaled_softmax_fwd",
        lambda w, k: lambda: ops.scaled_softmax_fwd(_first(w.xd, k, w.sk), scale=_SCALE),
        (reference_scaled_softmax_fwd, lambda w: reference_scaled_softmax_fwd(w.xd, scale=_SCALE)),
        lambda w, k: k * 2 * w.sk * w.es,
        fresh="xd",
        units=lambda w: w.n // w.sk,
    ),
    _Kernel(
        "scaled_masked_softmax fwd",
        ("torch x*s -> masked_fill -> softmax", lambda w: _masked(w.xd, w.mask)),
        "mpnb scaled_masked_softmax_fwd",
        _masked_kernel,
        (
            reference_scaled_masked_softmax_fwd,
            lambda w: reference_scaled_masked_softmax_fwd(w.xd, w.mask, scale=_SCALE),
        ),
        lambda w, k: k * (2 * w.sk * w.es + w.sk),
        fresh="xd",
        units=lambda w: w.sq,
        total=lambda w: 2 * w.n * w.es + w.n // w.heads,
    ),
    _Kernel(
        "scaled_softmax bwd",
        (
            "torch aten._softmax_backward_data * s",
            lambda w: torch._softmax_backward_data(w.dy, w.y, -1, w.dtype).mul_(_SCALE),
        ),
        "mpnb scaled_softmax_bwd",
        lambda w, k: (
            lambda: ops.scaled_softmax_bwd(
                _first(w.dy, k, w.sk), _first(w.y, k, w.sk), scale=_SCALE
            )
        ),
        (
            reference_scaled_softmax_bwd,
            lambda w: reference_scaled_softmax_bwd(w.dy, w.y, scale=_SCALE),
        ),
        lambda w, k: k * 3 * w.sk * w.es,
        fresh="dy",
        units=lambda w: w.n // w.sk,
    ),
    _Kernel(
        "causal softmax fwd",
        ("torch x*s -> masked_fill(triu) -> softmax", lambda w: _causal(w.cd, w.future)),
        "mpnb scaled_upper_triang_masked_softmax_fwd",
        _causal_fwd_kernel,
        (
            reference_scaled_upper_triang_masked_softmax_fwd,
            lambda w: reference_scaled_upper_triang_masked_softmax_fwd(w.cd, scale=_SCALE),
        ),
        lambda w, s: w.es * (_tri(s) + s * s),
        fresh="cd",
        units=lambda w: w.sk,
        total=lambda w: w.cd.shape[0] * w.es * (_tri(w.sk) + w.sk * w.sk),
        numel="cd",
        square=True,
    ),
    _Kernel(
        "causal softmax bwd",
        (
            "torch aten._softmax_backward_data * s",
            lambda w: torch._softmax_backward_data(w.dyc, w.yc, -1, w.dtype).mul_(_SCALE),
        ),
        "mpnb scaled_softmax_bwd upper_triang",
        _causal_bwd_kernel,
        (
            reference_scaled_softmax_bwd,
            lambda w: reference_scaled_softmax_bwd(w.dyc, w.yc, scale=_SCALE, upper_triang=True),
        ),
        lambda w, s: w.es * (2 * _tri(s) + s * s),
        fresh="cd",
        units=lambda w: w.sk,
        total=lambda w: w.cd.shape[0] * w.es * (2 * _tri(w.sk) + w.sk * w.sk),
        numel="cd",
        square=True,
    ),
)


def _softmax_cases(rows: int, sk: int, dtype: torch.dtype, work: str) -> Iterator[Case]:
    """The scaled, padding-masked and causal softmax on ``rows`` rows of ``sk`` columns:
    :data:`_SOFTMAX`."""
    g = torch.Generator().manual_seed(1)
    sq = min(sk, 1024)
    b, heads = 2, max(1, rows // (2 * sq))
    x = torch.randn(b, heads, sq, sk, generator=g).to(dtype).requires_grad_(True)
    mask = torch.rand(b, 1, sq, sk, generator=g) < 0.25
    dy = torch.randn(b, heads, sq, sk, generator=g).to(dtype)
    w = SimpleNamespace(g=g, x=x, mask=mask, dy=dy, rows=rows, sk=sk, sq=sq, heads=heads)
    w.dtype, w.n, w.es = dtype, x.numel(), x.element_size()
    yield from _walk(_SOFTMAX, w, work)


#: RoPE's workload: s, b, h, d (a bf16 tensor of 64 MiB), every channel rotated.
ROPE_SHAPE = (2048, 4, 32, 128)
# (the name, the layout passed, the memory order made, the permutation memory -> layout): the
# three layouts contiguous and the two views attention code passes, q.transpose(1, 2) of a
# [b, s, h, d] projection and a [b, h, s, d] tensor seen as Apex's [s, b, h, d].
_ROPE_LAYOUTS = (
    ("sbhd", "sbhd", "sbhd", (0, 1, 2, 3)),
    ("bshd", "bshd", "bshd", (0, 1, 2, 3)),
    ("bhsd", "bhsd", "bhsd", (0, 1, 2, 3)),
    ("bhsd view of bshd", "bhsd", "bshd", (0, 2, 1, 3)),
    ("sbhd view of bhsd", "sbhd", "bhsd", (2, 0, 1, 3)),
)


def _rope_cases(s: int, dtype: torch.dtype) -> Iterator[Case]:
    """RoPE forward and backward, one case each per layout: mpnb's kernel against the unfused
    PyTorch expression on the same tensor (``t * cos + rotate_half(t) * sin``; the backward
    rotates the other way), the compiled reference, the same-run bandwidth and the in-cache
    roofline (the first positions of ``t``, all of b, h and d). Bytes: t read and the output
    written, and the two fp32 tables read once."""
    _, b, h, d = ROPE_SHAPE
    size = dict(s=s, b=b, h=h, d=d)
    g = torch.Generator().manual_seed(2)
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    f = torch.cat([f, f], -1).float()
    cos, sin = f.cos(), f.sin()
    for name, layout, memory, perm in _ROPE_LAYOUTS:
        t = torch.randn([size[c] for c in memory], generator=g).to(dtype).permute(perm)
        # the tables broadcast over t's dims, in t's dtype (as the unfused expression runs)
        shape = [s if c == "s" else d if c == "d" else 1 for c in layout]
        c_t, s_t = cos.to(dtype).view(shape), sin.to(dtype).view(shape)
        n, es = t.numel(), t.element_size()
        unit = 2 * b * h * d * es + 2 * d * 4  # one position: its rows of t and y, its tables
        for direction, backward in (("fwd", False), ("bwd", True)):

            def unfused(t=t, c_t=c_t, s_t=s_t, backward=backward):
                x1, x2 = t.chunk(2, -1)
                turned = torch.cat((x2, -x1), -1) if backward else torch.cat((-x2, x1), -1)
                return t * c_t + turned * s_t

            def make(k, t=t, layout=layout, backward=backward):
                ts = t if k is None else t.narrow(layout.index("s"), 0, k)
                cs, ss = (cos, sin) if k is None else (cos[:k], sin[:k])
                return lambda: ops.rope(ts, cs, ss, group=d, backward=backward, layout=layout)

            yield _kernel_case(
                f"rope {direction} {name}",
                f"(s={s}, b={b}, h={h}, d={d}) {_name(dtype)}",
                Candidate("torch t*cos + rotate_half(t)*sin", unfused),
                f"mpnb rope layout={layout}",
                make,
                lambda k, unit=unit: k * unit,
                s,
                n,
                _compiled(
                    reference_rope,
                    lambda t=t, layout=layout, backward=backward: reference_rope(
                        t, cos, sin, group=d, backward=backward, layout=layout
                    ),
                ),
                fresh=t,
            )


def cases(opts: Options) -> Iterator[Case]:
    """Yield every case, one workload's tensors alive at a time."""
    for rows, cols in SHAPES:
        rows = max(8, int(rows * opts.scale)) // 8 * 8
        for dtype in (torch.float32, torch.bfloat16):
            work = f"({rows}, {cols}) {_name(dtype)}"
            yield from _norm_cases(rows, cols, dtype, work)
            yield from _softmax_cases(rows, cols, dtype, work)
    for dtype in (torch.float32, torch.bfloat16):
        yield from _rope_cases(max(8, int(ROPE_SHAPE[0] * opts.scale)), dtype)
