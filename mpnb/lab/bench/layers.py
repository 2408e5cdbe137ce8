"""Fused layers (RMS norm, layer norm, scaled masked / causal softmax, RoPE) vs PyTorch.

Workloads: rows x columns (8192, 4096) and (32768, 1024), fp32 and bf16. For softmax the
rows are ``[b, np, sq]`` attention rows with ``sk`` columns: the padding-masked case uses a
``[b, 1, sq, sk]`` bool mask, the causal case square ``[batches, sq, sq]`` scores.

RoPE: the forward on ``[s, b, h, d]`` = (2048, 4, 32, 128), fp32 and bf16, one case per
layout (``[s, b, h, d]``, ``[b, s, h, d]``, ``[b, h, s, d]`` contiguous, and the strided views
``q.transpose(1, 2)`` of a ``[b, s, h, d]`` tensor and ``[b, h, s, d]`` seen as ``[s, b, h,
d]``) against PyTorch's unfused expression on the same tensor; compare the layouts by their
same-run bandwidth fraction (target 0.7).

Three kinds of case for the norms and softmax:

* ``fwd+bwd``: one forward and ``torch.autograd.grad`` (no ``.grad`` accumulation) through
  mpnb's module/function against PyTorch's: ``F.rms_norm``, ``F.layer_norm`` and the composite
  ``softmax(masked_fill(x * scale, mask, -10000))``. Targets from the issue.
* ``fwd`` and ``bwd`` (fp32): the kernel alone against PyTorch's (``aten`` backward where one
  exists) and against the same-run memory bound, with the least traffic as ``bytes``
  (forward: read x, write y; backward: read x or y and dy, write dx). Targets: forward at
  least 1/1.3 and backward at least 1/1.6 of the ``a += s*b`` bandwidth.

Every case also times ``torch.compile`` of mpnb's pure-PyTorch reference of the op (the
forward compiled, the backward through it), its compile time apart (``--no-compile`` skips it).

Outputs are allocated fresh on every call by both sides. With glibc's default allocator a
fresh output of 32 MiB or more is page-faulted on every call; run the suite twice, plain and
with ``MALLOC_MMAP_MAX_=0`` (the header reports it), to see the difference. mpnb's layer
kernels advise transparent huge pages (``madvise(MADV_HUGEPAGE)``) on outputs of 16 MiB or
more, so in the plain run their fresh outputs fault 2 MiB at a time; PyTorch's outputs do the
same only with ``THP_MEM_ALLOC_ENABLE=1`` (c10's switch for the same advice), which a fair
plain-allocator comparison should also set. With ``MALLOC_MMAP_MAX_=0`` the heap reuses
memory that is already backed and the advice changes nothing.
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
    reference_scaled_upper_triang_masked_softmax_fwd,
)
from mpnb.lab.bench._harness import RMW, Candidate, Case, Options, compiled

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
_FWD_BW, _BWD_BW = 1 / 1.3, 1 / 1.6
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
    if dtype != torch.float32:
        return
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    _, mean, rstd = ops.layer_norm_fwd(xd, [cols], wd, bd, 1e-5)
    _, rrms = ops.rms_norm_fwd(xd, [cols], wd, 1e-5)
    yield Case(
        "layer_norm fwd",
        work,
        [
            Candidate("torch F.layer_norm", lambda: F.layer_norm(xd, [cols], wd, bd, 1e-5)),
            Candidate(
                "mpnb layer_norm_fwd",
                lambda: ops.layer_norm_fwd(xd, [cols], wd, bd),
                2 * n * es,
                RMW,
                bw_target=_FWD_BW,
            ),
            _compiled(
                reference_layer_norm_fwd,
                lambda: reference_layer_norm_fwd(xd, [cols], wd, bd, eps=1e-5),
                bytes=2 * n * es,
            ),
        ],
        bandwidth_numel=n,
    )
    mean_t, rstd_t = mean.view(rows, 1), rstd.view(rows, 1)
    yield Case(
        "layer_norm bwd",
        work,
        [
            Candidate(
                "torch aten.native_layer_norm_backward",
                lambda: torch.ops.aten.native_layer_norm_backward(
                    dy, xd, [cols], mean_t, rstd_t, wd, bd, [True, True, True]
                ),
            ),
            Candidate(
                "mpnb layer_norm_bwd",
                lambda: ops.layer_norm_bwd(dy, xd, mean, rstd, [cols], wd, bd),
                3 * n * es,
                RMW,
                bw_target=_BWD_BW,
            ),
            _compiled(
                reference_layer_norm_bwd,
                lambda: reference_layer_norm_bwd(dy, xd, mean, rstd, [cols], weight=wd, bias=bd),
                bytes=3 * n * es,
            ),
        ],
        bandwidth_numel=n,
    )
    yield Case(
        "rms_norm fwd",
        work,
        [
            Candidate("torch F.rms_norm", lambda: F.rms_norm(xd, [cols], wd, 1e-5)),
            Candidate(
                "mpnb rms_norm_fwd",
                lambda: ops.rms_norm_fwd(xd, [cols], wd),
                2 * n * es,
                RMW,
                bw_target=_FWD_BW,
            ),
            _compiled(
                reference_rms_norm_fwd,
                lambda: reference_rms_norm_fwd(xd, [cols], wd, eps=1e-5),
                bytes=2 * n * es,
            ),
        ],
        bandwidth_numel=n,
    )
    yt = F.rms_norm(x, [cols], w, 1e-5)
    yield Case(
        "rms_norm bwd",
        work,
        [
            Candidate(
                "torch autograd of F.rms_norm",
                lambda: torch.autograd.grad(yt, (x, w), dy, retain_graph=True),
            ),
            Candidate(
                "mpnb rms_norm_bwd",
                lambda: ops.rms_norm_bwd(dy, xd, rrms, [cols], wd),
                3 * n * es,
                RMW,
                bw_target=_BWD_BW,
            ),
            _compiled(
                reference_rms_norm_bwd,
                lambda: reference_rms_norm_bwd(dy, xd, rrms, [cols], weight=wd),
                bytes=3 * n * es,
            ),
        ],
        bandwidth_numel=n,
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
    if dtype != torch.float32:
        return
    xd = x.detach()
    y = ops.scaled_masked_softmax_fwd(xd, mask, _SCALE)
    yield Case(
        "scaled_masked_softmax fwd",
        work,
        [
            Candidate("torch x*s -> masked_fill -> softmax", lambda: composite(xd)),
            Candidate(
                "mpnb scaled_masked_softmax_fwd",
                lambda: ops.scaled_masked_softmax_fwd(xd, mask, _SCALE),
                2 * n * es + n // heads,
                RMW,
                bw_target=_FWD_BW,
            ),  # + the mask, once
            _compiled(
                reference_scaled_masked_softmax_fwd,
                lambda: reference_scaled_masked_softmax_fwd(xd, mask, scale=_SCALE),
                bytes=2 * n * es + n // heads,
            ),
        ],
        bandwidth_numel=n,
    )
    yield Case(
        "scaled_softmax bwd",
        work,
        [
            Candidate(
                "torch aten._softmax_backward_data * s",
                lambda: torch._softmax_backward_data(dy, y, -1, dtype).mul_(_SCALE),
            ),
            Candidate(
                "mpnb scaled_softmax_bwd",
                lambda: ops.scaled_softmax_bwd(dy, y, _SCALE),
                3 * n * es,
                RMW,
                bw_target=_BWD_BW,
            ),
            _compiled(
                reference_scaled_softmax_bwd,
                lambda: reference_scaled_softmax_bwd(dy, y, scale=_SCALE),
                bytes=3 * n * es,
            ),
        ],
        bandwidth_numel=n,
    )


#: RoPE's workload: s, b, h, d (a bf16 tensor of 64 MiB), every channel rotated.
ROPE_SHAPE = (2048, 4, 32, 128)
_ROPE_BW = 0.7
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
    """RoPE forward, one case per layout: mpnb's kernel against the unfused PyTorch expression
    on the same tensor (``t * cos + rotate_half(t) * sin``), the compiled reference, and the
    same-run bandwidth."""
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

        def unfused(t=t, c_t=c_t, s_t=s_t):
            x1, x2 = t.chunk(2, -1)
            return t * c_t + torch.cat((-x2, x1), -1) * s_t

        n, es = t.numel(), t.element_size()
        yield Case(
            f"rope fwd {name}",
            f"(s={s}, b={b}, h={h}, d={d}) {_name(dtype)}",
            [
                Candidate("torch t*cos + rotate_half(t)*sin", unfused),
                Candidate(
                    f"mpnb rope layout={layout}",
                    lambda t=t, layout=layout: ops.rope(t, cos, sin, d, layout=layout),
                    2 * n * es + 2 * cos.numel() * 4,
                    RMW,
                    bw_target=_ROPE_BW,
                ),
                _compiled(
                    reference_rope,
                    lambda t=t, layout=layout: reference_rope(t, cos, sin, d, layout=layout),
                ),
            ],
            bandwidth_numel=n,
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
