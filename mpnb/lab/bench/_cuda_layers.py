"""The ``cuda`` bench suite's helpers and its layer cases (norms, softmax, RoPE in bf16).

See :mod:`mpnb.lab.bench.cuda` for the method and the baselines. Every case runs by the
suite's rounds rule (:data:`ENOUGH`) in rounds of :data:`ROUND_TIME`, and is compared with the
same-run device copy bandwidth.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from mpnb.core.ops.rms_norm import reference_rms_norm_bwd
from mpnb.core.ops.rotary import reference_rope
from mpnb.core.ops.triton import launcher
from mpnb.lab.bench._harness import COPY, Candidate, Case, Enough

__all__ = [
    "ENOUGH",
    "ROUND_TIME",
    "TritonRow",
    "case",
    "randn",
    "walk",
    "norm_cases",
    "softmax_cases",
    "rope_case",
]

#: Enough rounds: at least ``Options.rounds`` (15), then 5 more at a time until every ratio's
#: 95% interval is within 2% of it on either side, or 40 rounds, or 1 s of rounds per case.
ENOUGH = Enough(half_width=0.02, max_rounds=40, max_s=1.0, step=5)
#: Seconds each callable runs per round: a GPU call takes microseconds to a few ms, so a
#: 5 ms round is many calls (or at least one) between two synchronizations.
ROUND_TIME = 0.005


def case(name, work, base, ours, nbytes, access, numel, dev, target=None) -> Case:
    """A Case of ``base`` (PyTorch) and ``ours`` (mpnb), ``(name, fn)`` each, both warmed up,
    timed by the suite's rounds rule; ``target``: the speed-up ``ours`` must reach."""
    base[1](), ours[1]()  # compile and warm up both before anything is timed
    return Case(
        name,
        work,
        [Candidate(*base, nbytes, access), Candidate(*ours, nbytes, access, target=target)],
        bandwidth_numel=numel,
        device=dev,
        enough=ENOUGH,
        round_time=ROUND_TIME,
    )


def randn(numels, dtype, dev, seed, scale=1.0) -> list[torch.Tensor]:
    """One seeded ``randn * scale`` tensor per element count, drawn on ``dev`` by a generator of
    that device (a 256 MiB tensor drawn on the host would cost seconds)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    return [(torch.randn(n, generator=g, device=dev) * scale).to(dtype) for n in numels]


@dataclass(frozen=True)
class TritonRow:
    """One case of the suite: a Triton kernel against PyTorch's path for the same work.

    Attributes:
        name: the case's name.
        torch: PyTorch's candidate, ``(name, f)``: ``f(w)`` on the workload ``w``.
        op: the ``mpnb::`` op whose Triton launcher is timed (``"triton <op>"``).
        call: ``call(w, kernel)``, the launcher's call on ``w``, the op's scalars by keyword.
        bytes_per_elem: the least traffic per element of the workload (its ``n``).
        access: :data:`~mpnb.lab.bench._harness.COPY` or ``READ`` (the bandwidth baseline).
        needs: a tensor of ``w`` the case needs, by name: no case where it is None ("": none).
        fallback: PyTorch's candidate, ``(name, f)`` as ``torch``, where ``torch``'s first call
            raises ``NotImplementedError`` or ``RuntimeError`` (an op this build of torch lacks
            for the device), or None.
    """

    name: str
    torch: tuple[str, Callable]
    op: str
    call: Callable
    bytes_per_elem: int
    access: str = COPY
    needs: str = ""
    fallback: tuple[str, Callable] | None = None

    def baseline(self, w: SimpleNamespace) -> tuple[str, Callable]:
        """PyTorch's ``(name, fn)`` on ``w``: ``torch``, or ``fallback`` where it fails."""
        base = (self.torch[0], partial(self.torch[1], w))
        if self.fallback is None:
            return base
        try:
            base[1]()
        except (NotImplementedError, RuntimeError):
            return (self.fallback[0], partial(self.fallback[1], w))
        return base


def walk(table: tuple, w: SimpleNamespace, work: str, dev: str) -> Iterator[Case]:
    """Each :class:`TritonRow`'s case on ``w`` (its ``n`` elements), in order; a step (a plain
    function of ``w``) runs when it is reached, setting the tensors the next rows need, so that
    a case's tensors exist only from the case that needs them on. Each case holds ``w`` as it
    stood when the case was built (a step that replaces a tensor changes no earlier case)."""
    for row in table:
        if not isinstance(row, TritonRow):
            row(w)
        elif not row.needs or getattr(w, row.needs) is not None:
            now = SimpleNamespace(**vars(w))
            base = row.baseline(now)
            ours = (f"triton {row.op}", partial(row.call, now, launcher(row.op)))
            nbytes = row.bytes_per_elem * w.n
            yield case(row.name, work, base, ours, nbytes, row.access, w.n, dev)


# ---- layers --------------------------------------------------------------------------------

_S = 0.125  # the softmax cases' scale


def _ln_stats(w: SimpleNamespace) -> None:
    """PyTorch's layer norm statistics (``[rows, 1]``, in x's dtype) for its backward."""
    _, w.mean, w.rstd = torch.native_layer_norm(w.x, [w.cols], w.wt, w.b, 1e-5)


def _ln_stats32(w: SimpleNamespace) -> None:
    """The same statistics flat in fp32, as mpnb's backward takes them."""
    w.mean32, w.rstd32 = w.mean.view(-1).float(), w.rstd.view(-1).float()


def _rms_stats(w: SimpleNamespace) -> None:
    """PyTorch's RMS norm statistic (aten's ``[rows, 1]``) and mpnb's flat fp32 one."""
    _, w.rrstd = torch.ops.aten._fused_rms_norm(w.x, [w.cols], w.wt, 1e-5)
    w.rrstd32 = w.rrstd.view(-1).float()


_NORMS = (
    _ln_stats,
    TritonRow(
        "layer_norm fwd",
        ("torch F.layer_norm", lambda w: F.layer_norm(w.x, [w.cols], w.wt, w.b, 1e-5)),
        "layer_norm_fwd",
        lambda w, k: k(w.x, [w.cols], weight=w.wt, bias=w.b, eps=1e-5),
        4,
    ),
    _ln_stats32,
    TritonRow(
        "layer_norm bwd",
        (
            "torch aten.native_layer_norm_backward",
            lambda w: torch.ops.aten.native_layer_norm_backward(
                w.dy, w.x, [w.cols], w.mean, w.rstd, w.wt, w.b, [True, True, True]
            ),
        ),
        "layer_norm_bwd",
        lambda w, k: k(
            w.dy,
            w.x,
            w.mean32,
            w.rstd32,
            [w.cols],
            weight=w.wt,
            bias=w.b,
            memory_efficient=False,
        ),
        6,
    ),
    _rms_stats,
    TritonRow(
        "rms_norm fwd",
        ("torch F.rms_norm", lambda w: F.rms_norm(w.x, [w.cols], w.wt, 1e-5)),
        "rms_norm_fwd",
        lambda w, k: k(w.x, [w.cols], weight=w.wt, eps=1e-5),
        4,
    ),
    TritonRow(
        "rms_norm bwd",
        (
            "torch aten._fused_rms_norm_backward",
            lambda w: torch.ops.aten._fused_rms_norm_backward(
                w.dy, w.x, [w.cols], w.rrstd, w.wt, [True, True]
            ),
        ),
        "rms_norm_bwd",
        lambda w, k: k(w.dy, w.x, w.rrstd32, [w.cols], weight=w.wt, memory_efficient=False),
        6,
        # where this build has no fused RMS norm backward for the device: the backward in
        # PyTorch ops (mpnb's reference; ``rrstd`` is aten's ``[rows, 1]``)
        fallback=(
            "torch ops (mpnb reference)",
            lambda w: reference_rms_norm_bwd(w.dy, w.x, w.rrstd.view(-1), [w.cols], weight=w.wt),
        ),
    ),
)


def norm_cases(rows: int, cols: int, dev: str, tag: str = "") -> Iterator[Case]:
    """Layer norm and RMS norm, forward and backward, on ``rows x cols`` bf16 rows (``tag``
    starts the workload's label: ``"(L) "`` for the large size): :data:`_NORMS`."""
    dt, n = torch.bfloat16, rows * cols
    x, dy = randn([n], dt, dev, 2)[0].view(rows, cols), randn([n], dt, dev, 3)[0].view(rows, cols)
    wt, b = torch.rand(cols, device=dev).add(0.5).to(dt), torch.randn(cols, device=dev).to(dt)
    w = SimpleNamespace(x=x, dy=dy, wt=wt, b=b, cols=cols, n=n)
    yield from walk(_NORMS, w, f"{tag}{rows}x{cols} bf16", dev)


def _softmax_output(w: SimpleNamespace) -> None:
    """The softmax's output, the backward's input."""
    w.y = torch.softmax(w.x.float(), -1).to(w.x.dtype)


_SOFTMAX = (
    TritonRow(
        "softmax fwd",
        ("torch softmax(x * s)", lambda w: torch.softmax(w.x * _S, -1)),
        "scaled_softmax_fwd",
        lambda w, k: k(w.x, scale=_S),
        4,
    ),
    TritonRow(
        "masked softmax fwd",
        (
            "torch softmax(masked_fill(x * s))",
            lambda w: torch.softmax((w.x * _S).masked_fill_(w.pad, -10000.0), -1),
        ),
        "scaled_masked_softmax_fwd",
        lambda w, k: k(w.x, w.pad, scale=_S),
        4,
    ),
    TritonRow(
        "causal softmax fwd",
        (
            "torch softmax(masked_fill(x * s, triu))",
            lambda w: torch.softmax((w.x * _S).masked_fill_(w.future, float("-inf")), -1),
        ),
        "scaled_upper_triang_masked_softmax_fwd",
        lambda w, k: k(w.x, scale=_S),
        4,
    ),
    _softmax_output,
    TritonRow(
        "softmax bwd",
        (
            "torch aten._softmax_backward_data * s",
            lambda w: torch._softmax_backward_data(w.dy, w.y, -1, w.y.dtype).mul_(_S),
        ),
        "scaled_softmax_bwd",
        lambda w, k: k(w.dy, w.y, scale=_S),
        6,
    ),
)


def softmax_cases(b: int, h: int, sq: int, dev: str, tag: str = "") -> Iterator[Case]:
    """Plain, padding-masked and causal softmax forward, and the backward, on
    ``[b, h, sq, sq]`` bf16 scores (``tag`` as for :func:`norm_cases`): :data:`_SOFTMAX`."""
    n = b * h * sq * sq
    x = randn([n], torch.bfloat16, dev, 4)[0].view(b, h, sq, sq)
    dy = randn([n], torch.bfloat16, dev, 5)[0].view(b, h, sq, sq)
    pad = torch.zeros(b, 1, sq, sq, dtype=torch.bool, device=dev)
    pad[..., sq - sq // 8 :] = True
    future = torch.ones(sq, sq, dtype=torch.bool, device=dev).triu(1)
    w = SimpleNamespace(x=x, dy=dy, pad=pad, future=future, n=n)
    yield from walk(_SOFTMAX, w, f"{tag}[{b},{h},{sq},{sq}] bf16", dev)


_ROPE = (
    TritonRow(
        "rope fwd",
        ("torch ops (mpnb reference)", lambda w: reference_rope(w.t, w.cos, w.sin, group=w.d)),
        "rope",
        lambda w, k: k(w.t, w.cos, w.sin, group=w.d),
        4,
    ),
)


def rope_case(s: int, b: int, h: int, d: int, dev: str, tag: str = "") -> Case:
    """RoPE over all ``d`` channels of ``[s, b, h, d]`` bf16 against the PyTorch-ops reference
    (``tag`` as for :func:`norm_cases`): :data:`_ROPE`."""
    n = s * b * h * d
    t = randn([n], torch.bfloat16, dev, 6)[0].view(s, b, h, d)
    angles = torch.randn(s, d, device=dev)
    w = SimpleNamespace(t=t, cos=angles.cos(), sin=angles.sin(), d=d, n=n)
    (only,) = walk(_ROPE, w, f"{tag}[{s},{b},{h},{d}] bf16", dev)
    return only
