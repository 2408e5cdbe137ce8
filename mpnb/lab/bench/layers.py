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

from collections.abc import Iterator

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


def _kernel_case(
    name: str,
    work: str,
    torch_cand: Candidate,
    mpnb_name: str,
    make,
    unit_bytes: int,
    units: int,
    numel: int,
    compiled_cand: Candidate,
    bytes: int | None = None,
    fresh: torch.Tensor | None = None,
) -> Case:
    """A kernel alone against PyTorch's, the same-run bandwidth and its in-cache roofline.

    Args:
        name, work: the case's name and workload.
        torch_cand: PyTorch's candidate (the baseline).
        mpnb_name: mpnb's candidate's name.
        make: ``make(k)`` is a zero-argument call of mpnb's kernel on the first ``k`` units
            (rows, positions) of the workload, ``make(None)`` on the whole workload.
        unit_bytes: the least bytes one unit moves (reads and writes); the whole workload
            moves ``units * unit_bytes`` unless ``bytes`` says otherwise.
        units: the units a slice may have at most.
        numel: the fp32 elements of the bandwidth baseline (the workload's element count).
        compiled_cand: the compiled reference.
        bytes: the whole workload's bytes, where they are not ``units * unit_bytes``.
        fresh: a tensor shaped as the kernel's output: its ``clone()`` (a fresh output of the
            same size, read and written once) is timed too, the floor a kernel that returns a
            fresh output sits on (the OS zeroes every page of it on first touch).
    """
    k = cache_resident(unit_bytes, most=units)  # None: the L2 size is not known, no roofline
    roofline = None
    if k is not None:
        small = max(1, k // 4)
        roofline = InCache(make(k), k * unit_bytes, make(small), small * unit_bytes)
    mpnb_cand = Candidate(
        mpnb_name,
        make(None),
        units * unit_bytes if bytes is None else bytes,
        RMW,
        bw_target=_BW,
        in_cache=roofline,
    )
    cands = [torch_cand, mpnb_cand, compiled_cand]
    if fresh is not None:
        cands.append(_fresh_floor(fresh))
    return Case(name, work, cands, bandwidth_numel=numel)


def _fresh_floor(t: torch.Tensor) -> Candidate:
    """``t.clone()``: a fresh output of ``t``'s size read and written once, with its bytes."""
    return Candidate("floor: x.clone() (fresh output)", t.clone, 2 * t.numel() * t.element_size())


def _norm_cases(rows: int, cols: int, dtype: torch.dtype, work: str) -> Iterator[Case]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g).to(dtype).requires_grad_(True)
    w = (torch.rand(cols, generator=g) + 0.5).to(dtype).requires_grad_(True)
    b = torch.randn(cols, generator=g).to(dtype).requires_grad_(True)
    dy = torch.randn(rows, cols, generator=g).to(dtype)
    n, es = rows * cols, x.element_size()
    yield Case(
        "rms_norm fwd+bwd",
        work,
        [
            Candidate(
                "torch F.rms_norm",
                _fwd_bwd(lambda x, w: F.rms_norm(x, [cols], w, 1e-5), (x, w), dy),
            ),
            Candidate(
                "mpnb FusedRMSNorm",
                _fwd_bwd(lambda x, w: ops.rms_norm_fwd(x, [cols], w, 1e-5)[0], (x, w), dy),
                target=_TARGETS[("rms", dtype)],
            ),
            _compiled(
                reference_rms_norm_fwd,
                lambda x, w: reference_rms_norm_fwd(x, [cols], w, eps=1e-5)[0],
                (x, w),
                dy,
            ),
        ],
    )
    yield Case(
        "layer_norm fwd+bwd",
        work,
        [
            Candidate(
                "torch F.layer_norm",
                _fwd_bwd(lambda x, w, b: F.layer_norm(x, [cols], w, b, 1e-5), (x, w, b), dy),
            ),
            Candidate(
                "mpnb FusedLayerNorm",
                _fwd_bwd(
                    lambda x, w, b: ops.layer_norm_fwd(x, [cols], w, b, 1e-5)[0], (x, w, b), dy
                ),
                target=_TARGETS[("ln", dtype)],
            ),
            _compiled(
                reference_layer_norm_fwd,
                lambda x, w, b: reference_layer_norm_fwd(x, [cols], w, b, eps=1e-5)[0],
                (x, w, b),
                dy,
            ),
        ],
    )
    xd, wd, bd, rd = x.detach(), w.detach(), b.detach(), rows
    _, mean, rstd = ops.layer_norm_fwd(xd, [cols], wd, bd, 1e-5)
    _, rrms = ops.rms_norm_fwd(xd, [cols], wd, 1e-5)
    # PyTorch's backward takes its own forward's statistics (in x's dtype for half x)
    _, mean_t, rstd_t = torch.ops.aten.native_layer_norm(xd, [cols], wd, bd, 1e-5)
    yt = F.rms_norm(x, [cols], w, 1e-5)
    # bytes per row: x read and y written (+ the fp32 mean and rstd written); the backward reads
    # dy and x (+ mean and rstd) and writes dx
    ln_fwd, rms_fwd = 2 * cols * es + 8, 2 * cols * es + 4
    ln_bwd, rms_bwd = 3 * cols * es + 8, 3 * cols * es + 4
    yield _kernel_case(
        "layer_norm fwd",
        work,
        Candidate("torch F.layer_norm", lambda: F.layer_norm(xd, [cols], wd, bd, 1e-5)),
        "mpnb layer_norm_fwd",
        lambda k: lambda: ops.layer_norm_fwd(xd[:k], [cols], wd, bd),
        ln_fwd,
        rd,
        n,
        _compiled(
            reference_layer_norm_fwd,
            lambda: reference_layer_norm_fwd(xd, [cols], wd, bd, eps=1e-5),
            bytes=ln_fwd * rd,
        ),
        fresh=xd,
    )
    yield _kernel_case(
        "layer_norm bwd",
        work,
        Candidate(
            "torch aten.native_layer_norm_backward",
            lambda: torch.ops.aten.native_layer_norm_backward(
                dy, xd, [cols], mean_t, rstd_t, wd, bd, [True, True, True]
            ),
        ),
        "mpnb layer_norm_bwd",
        lambda k: lambda: ops.layer_norm_bwd(dy[:k], xd[:k], mean[:k], rstd[:k], [cols], wd, bd),
        ln_bwd,
        rd,
        n,
        _compiled(
            reference_layer_norm_bwd,
            lambda: reference_layer_norm_bwd(dy, xd, mean, rstd, [cols], weight=wd, bias=bd),
            bytes=ln_bwd * rd,
        ),
        fresh=dy,
    )
    yield _kernel_case(
        "rms_norm fwd",
        work,
        Candidate("torch F.rms_norm", lambda: F.rms_norm(xd, [cols], wd, 1e-5)),
        "mpnb rms_norm_fwd",
        lambda k: lambda: ops.rms_norm_fwd(xd[:k], [cols], wd),
        rms_fwd,
        rd,
        n,
        _compiled(
            reference_rms_norm_fwd,
            lambda: reference_rms_norm_fwd(xd, [cols], wd, eps=1e-5),
            bytes=rms_fwd * rd,
        ),
        fresh=xd,
    )
    yield _kernel_case(
        "rms_norm bwd",
        work,
        Candidate(
            "torch autograd of F.rms_norm",
            lambda: torch.autograd.grad(yt, (x, w), dy, retain_graph=True),
        ),
        "mpnb rms_norm_bwd",
        lambda k: lambda: ops.rms_norm_bwd(dy[:k], xd[:k], rrms[:k], [cols], wd),
        rms_bwd,
        rd,
        n,
        _compiled(
            reference_rms_norm_bwd,
            lambda: reference_rms_norm_bwd(dy, xd, rrms, [cols], weight=wd),
            bytes=rms_bwd * rd,
        ),
        fresh=dy,
    )


def _softmax_cases(rows: int, sk: int, dtype: torch.dtype, work: str) -> Iterator[Case]:
    g = torch.Generator().manual_seed(1)
    sq = min(sk, 1024)
    b, heads = 2, max(1, rows // (2 * sq))
    x = torch.randn(b, heads, sq, sk, generator=g).to(dtype).requires_grad_(True)
    mask = torch.rand(b, 1, sq, sk, generator=g) < 0.25
    dy = torch.randn(b, heads, sq, sk, generator=g).to(dtype)
    n, es = x.numel(), x.element_size()

    def composite(x):
        return torch.softmax((x * _SCALE).masked_fill(mask, -10000.0), -1)

    yield Case(
        "scaled_masked_softmax fwd+bwd",
        work,
        [
            Candidate("torch x*s -> masked_fill -> softmax", _fwd_bwd(composite, (x,), dy)),
            Candidate(
                "mpnb scaled_masked_softmax",
                _fwd_bwd(lambda x: ops.scaled_masked_softmax_fwd(x, mask, _SCALE), (x,), dy),
                target=_TARGETS[("masked", dtype)],
            ),
            _compiled(
                reference_scaled_masked_softmax_fwd,
                lambda x: reference_scaled_masked_softmax_fwd(x, mask, scale=_SCALE),
                (x,),
                dy,
            ),
        ],
    )
    c = torch.randn(max(1, rows // sk), sk, sk, generator=g).to(dtype).requires_grad_(True)
    dyc = torch.randn(max(1, rows // sk), sk, sk, generator=g).to(dtype)
    future = torch.ones(sk, sk, dtype=torch.bool).triu(1)
    yield Case(
        "causal softmax fwd+bwd",
        work,
        [
            Candidate(
                "torch x*s -> masked_fill(triu) -> softmax",
                _fwd_bwd(
                    lambda c: torch.softmax((c * _SCALE).masked_fill(future, -10000.0), -1),
                    (c,),
                    dyc,
                ),
            ),
            Candidate(
                "mpnb scaled_upper_triang_masked_softmax",
                _fwd_bwd(
                    lambda c: ops.scaled_upper_triang_masked_softmax_fwd(c, _SCALE),
                    (c,),
                    dyc,
                ),
                target=_TARGETS[("causal", dtype)],
            ),
            _compiled(
                reference_scaled_upper_triang_masked_softmax_fwd,
                lambda c: reference_scaled_upper_triang_masked_softmax_fwd(c, scale=_SCALE),
                (c,),
                dyc,
            ),
        ],
    )
    xd, cd = x.detach(), c.detach()
    y = ops.scaled_masked_softmax_fwd(xd, mask, _SCALE)
    yc = ops.scaled_upper_triang_masked_softmax_fwd(cd, _SCALE)
    rows_all = n // sk

    def first(t, k):  # the first k rows of [b, np, sq, sk] scores as [1, 1, k, sk]; None: all
        return t if k is None else t.reshape(-1, sk)[:k].view(1, 1, k, sk)

    yield _kernel_case(
        "scaled_softmax fwd",
        work,
        Candidate("torch softmax(x*s)", lambda: torch.softmax(xd * _SCALE, -1)),
        "mpnb scaled_softmax_fwd",
        lambda k: lambda: ops.scaled_softmax_fwd(first(xd, k), _SCALE),
        2 * sk * es,
        rows_all,
        n,
        _compiled(
            reference_scaled_softmax_fwd,
            lambda: reference_scaled_softmax_fwd(xd, scale=_SCALE),
            bytes=2 * n * es,
        ),
        fresh=xd,
    )

    # the [b, 1, sq, sk] mask is read once for all heads at full size (n // heads bytes); the
    # in-cache slices are rows of one head, each with its own mask row
    def masked(k):
        if k is None:
            return lambda: ops.scaled_masked_softmax_fwd(xd, mask, _SCALE)
        xs, ms = xd[:1, :1, :k].contiguous(), mask[:1, :, :k].contiguous()
        return lambda: ops.scaled_masked_softmax_fwd(xs, ms, _SCALE)

    yield _kernel_case(
        "scaled_masked_softmax fwd",
        work,
        Candidate("torch x*s -> masked_fill -> softmax", lambda: composite(xd)),
        "mpnb scaled_masked_softmax_fwd",
        masked,
        2 * sk * es + sk,
        sq,
        n,
        _compiled(
            reference_scaled_masked_softmax_fwd,
            lambda: reference_scaled_masked_softmax_fwd(xd, mask, scale=_SCALE),
            bytes=2 * n * es + n // heads,
        ),
        bytes=2 * n * es + n // heads,
        fresh=xd,
    )
    yield _kernel_case(
        "scaled_softmax bwd",
        work,
        Candidate(
            "torch aten._softmax_backward_data * s",
            lambda: torch._softmax_backward_data(dy, y, -1, dtype).mul_(_SCALE),
        ),
        "mpnb scaled_softmax_bwd",
        lambda k: lambda: ops.scaled_softmax_bwd(first(dy, k), first(y, k), _SCALE),
        3 * sk * es,
        rows_all,
        n,
        _compiled(
            reference_scaled_softmax_bwd,
            lambda: reference_scaled_softmax_bwd(dy, y, scale=_SCALE),
            bytes=3 * n * es,
        ),
        fresh=dy,
    )
    yield from _causal_cases(cd, dyc, yc, future, work)


def _causal_cases(c, dy, y, future, work: str) -> Iterator[Case]:
    """The causal softmax's kernels alone: row i of each ``[sq, sq]`` matrix reads its first
    i + 1 scores (the forward) or gradients and outputs (the backward) and writes all sq
    outputs. The kernel takes square scores only, so its in-cache slices are the leading
    ``[S, S]`` blocks of the first matrix, S as large as fits."""
    batches, sq, _ = c.shape
    es, n = c.element_size(), c.numel()

    def tri(s: int) -> int:
        return s * (s + 1) // 2

    fwd_bytes = (lambda s: es * (tri(s) + s * s), "mpnb scaled_upper_triang_masked_softmax_fwd")
    bwd_bytes = (lambda s: es * (2 * tri(s) + s * s), "mpnb scaled_softmax_bwd upper_triang")

    def fwd(s):
        cs = c if s is None else c[:1, :s, :s].contiguous()
        return lambda: ops.scaled_upper_triang_masked_softmax_fwd(cs, _SCALE)

    def bwd(s):
        d, o = (dy, y) if s is None else (dy[:1, :s, :s].contiguous(), y[:1, :s, :s].contiguous())
        return lambda: ops.scaled_softmax_bwd(d, o, _SCALE, True)

    budget = cache_resident(1)  # bytes that stay in cache
    for name, (size, label), make, torch_cand, compiled_cand in (
        (
            "causal softmax fwd",
            fwd_bytes,
            fwd,
            Candidate(
                "torch x*s -> masked_fill(triu) -> softmax",
                lambda: torch.softmax((c * _SCALE).masked_fill(future, -10000.0), -1),
            ),
            _compiled(
                reference_scaled_upper_triang_masked_softmax_fwd,
                lambda: reference_scaled_upper_triang_masked_softmax_fwd(c, scale=_SCALE),
                bytes=batches * fwd_bytes[0](sq),
            ),
        ),
        (
            "causal softmax bwd",
            bwd_bytes,
            bwd,
            Candidate(
                "torch aten._softmax_backward_data * s",
                lambda: torch._softmax_backward_data(dy, y, -1, dy.dtype).mul_(_SCALE),
            ),
            _compiled(
                reference_scaled_softmax_bwd,
                lambda: reference_scaled_softmax_bwd(dy, y, scale=_SCALE, upper_triang=True),
                bytes=batches * bwd_bytes[0](sq),
            ),
        ),
    ):
        roofline = None
        if budget is not None:  # the L2 size is known
            s = 16
            while s + 16 <= sq and size(s + 16) <= budget:
                s += 16
            roofline = InCache(make(s), size(s), make(s // 2), size(s // 2))
        cand = Candidate(
            label, make(None), batches * size(sq), RMW, bw_target=_BW, in_cache=roofline
        )
        floor = _fresh_floor(c)
        yield Case(name, work, [torch_cand, cand, compiled_cand, floor], bandwidth_numel=n)


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
                return lambda: ops.rope(ts, cs, ss, d, backward=backward, layout=layout)

            yield _kernel_case(
                f"rope {direction} {name}",
                f"(s={s}, b={b}, h={h}, d={d}) {_name(dtype)}",
                Candidate("torch t*cos + rotate_half(t)*sin", unfused),
                f"mpnb rope layout={layout}",
                make,
                unit,
                s,
                n,
                _compiled(
                    reference_rope,
                    lambda t=t, layout=layout, backward=backward: reference_rope(
                        t, cos, sin, d, backward=backward, layout=layout
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
