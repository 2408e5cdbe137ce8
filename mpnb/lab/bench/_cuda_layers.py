"""The ``cuda`` bench suite's helpers and its layer cases (norms, softmax, RoPE in bf16).

See :mod:`mpnb.lab.bench.cuda` for the method and the baselines. Every case runs by the
suite's rounds rule (:data:`ENOUGH`) in rounds of :data:`ROUND_TIME`, and is compared with the
same-run device copy bandwidth.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from mpnb.lab.bench._harness import COPY, Candidate, Case, Enough

__all__ = ["ENOUGH", "ROUND_TIME", "case", "randn", "norm_cases", "softmax_cases", "rope_case"]

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


# ---- layers --------------------------------------------------------------------------------


def norm_cases(rows: int, cols: int, dev: str, tag: str = "") -> Iterator[Case]:
    """Layer norm and RMS norm, forward and backward, on ``rows x cols`` bf16 rows (``tag``
    starts the workload's label: ``"(L) "`` for the large size)."""
    from mpnb.core.ops.triton import launcher

    work, dt, n = f"{tag}{rows}x{cols} bf16", torch.bfloat16, rows * cols
    x, dy = randn([n], dt, dev, 2)[0].view(rows, cols), randn([n], dt, dev, 3)[0].view(rows, cols)
    wt, b = torch.rand(cols, device=dev).add(0.5).to(dt), torch.randn(cols, device=dev).to(dt)
    ln_f, ln_b = launcher("layer_norm_fwd"), launcher("layer_norm_bwd")
    _, mean, rstd = torch.native_layer_norm(x, [cols], wt, b, 1e-5)
    yield case(
        "layer_norm fwd",
        work,
        ("torch F.layer_norm", lambda: F.layer_norm(x, [cols], wt, b, 1e-5)),
        ("triton layer_norm_fwd", lambda: ln_f(x, [cols], wt, b, 1e-5)),
        4 * n,
        COPY,
        n,
        dev,
    )
    mean32, rstd32 = mean.view(-1).float(), rstd.view(-1).float()
    yield case(
        "layer_norm bwd",
        work,
        (
            "torch aten.native_layer_norm_backward",
            lambda: torch.ops.aten.native_layer_norm_backward(
                dy, x, [cols], mean, rstd, wt, b, [True, True, True]
            ),
        ),
        ("triton layer_norm_bwd", lambda: ln_b(dy, x, mean32, rstd32, [cols], wt, b, False)),
        6 * n,
        COPY,
        n,
        dev,
    )
    rms_f, rms_b = launcher("rms_norm_fwd"), launcher("rms_norm_bwd")
    _, rrstd = torch.ops.aten._fused_rms_norm(x, [cols], wt, 1e-5)
    yield case(
        "rms_norm fwd",
        work,
        ("torch F.rms_norm", lambda: F.rms_norm(x, [cols], wt, 1e-5)),
        ("triton rms_norm_fwd", lambda: rms_f(x, [cols], wt, 1e-5)),
        4 * n,
        COPY,
        n,
        dev,
    )
    rrstd32 = rrstd.view(-1).float()
    yield case(
        "rms_norm bwd",
        work,
        _rms_backward(dy, x, cols, rrstd, wt),
        ("triton rms_norm_bwd", lambda: rms_b(dy, x, rrstd32, [cols], wt, False)),
        6 * n,
        COPY,
        n,
        dev,
    )


def _rms_backward(dy, x, cols, rstd, wt):
    # PyTorch's fused RMS norm backward where this build has one for the device, else the
    # backward in PyTorch ops (mpnb's reference). ``rstd`` is aten's ``[rows, 1]``.
    try:
        torch.ops.aten._fused_rms_norm_backward(dy, x, [cols], rstd, wt, [True, True])
    except (NotImplementedError, RuntimeError):
        from mpnb.core.ops.rms_norm import reference_rms_norm_bwd

        return (
            "torch ops (mpnb reference)",
            lambda: reference_rms_norm_bwd(dy, x, rstd.view(-1), [cols], wt),
        )
    return (
        "torch aten._fused_rms_norm_backward",
        lambda: torch.ops.aten._fused_rms_norm_backward(dy, x, [cols], rstd, wt, [True, True]),
    )


def softmax_cases(b: int, h: int, sq: int, dev: str, tag: str = "") -> Iterator[Case]:
    """Plain, padding-masked and causal softmax forward, and the backward, on
    ``[b, h, sq, sq]`` bf16 scores (``tag`` as for :func:`norm_cases`)."""
    from mpnb.core.ops.triton import launcher

    work, n, s = f"{tag}[{b},{h},{sq},{sq}] bf16", b * h * sq * sq, 0.125
    x = randn([n], torch.bfloat16, dev, 4)[0].view(b, h, sq, sq)
    dy = randn([n], torch.bfloat16, dev, 5)[0].view(b, h, sq, sq)
    pad = torch.zeros(b, 1, sq, sq, dtype=torch.bool, device=dev)
    pad[..., sq - sq // 8 :] = True
    future = torch.ones(sq, sq, dtype=torch.bool, device=dev).triu(1)
    plain, masked, causal = (
        launcher("scaled_softmax_fwd"),
        launcher("scaled_masked_softmax_fwd"),
        launcher("scaled_upper_triang_masked_softmax_fwd"),
    )
    yield case(
        "softmax fwd",
        work,
        ("torch softmax(x * s)", lambda: torch.softmax(x * s, -1)),
        ("triton scaled_softmax_fwd", lambda: plain(x, s)),
        4 * n,
        COPY,
        n,
        dev,
    )
    yield case(
        "masked softmax fwd",
        work,
        (
            "torch softmax(masked_fill(x * s))",
            lambda: torch.softmax((x * s).masked_fill_(pad, -10000.0), -1),
        ),
        ("triton scaled_masked_softmax_fwd", lambda: masked(x, pad, s)),
        4 * n,
        COPY,
        n,
        dev,
    )
    yield case(
        "causal softmax fwd",
        work,
        (
            "torch softmax(masked_fill(x * s, triu))",
            lambda: torch.softmax((x * s).masked_fill_(future, float("-inf")), -1),
        ),
        ("triton scaled_upper_triang_masked_softmax_fwd", lambda: causal(x, s)),
        4 * n,
        COPY,
        n,
        dev,
    )
    y, bwd = torch.softmax(x.float(), -1).to(x.dtype), launcher("scaled_softmax_bwd")
    yield case(
        "softmax bwd",
        work,
        (
            "torch aten._softmax_backward_data * s",
            lambda: torch._softmax_backward_data(dy, y, -1, y.dtype).mul_(s),
        ),
        ("triton scaled_softmax_bwd", lambda: bwd(dy, y, s)),
        6 * n,
        COPY,
        n,
        dev,
    )


def rope_case(s: int, b: int, h: int, d: int, dev: str, tag: str = "") -> Case:
    """RoPE over all ``d`` channels of ``[s, b, h, d]`` bf16 against the PyTorch-ops reference
    (``tag`` as for :func:`norm_cases`)."""
    from mpnb.core.ops.rotary import reference_rope
    from mpnb.core.ops.triton import launcher

    n = s * b * h * d
    t = randn([n], torch.bfloat16, dev, 6)[0].view(s, b, h, d)
    angles = torch.randn(s, d, device=dev)
    cos, sin, rope = angles.cos(), angles.sin(), launcher("rope")
    return case(
        "rope fwd",
        f"{tag}[{s},{b},{h},{d}] bf16",
        ("torch ops (mpnb reference)", lambda: reference_rope(t, cos, sin, d)),
        ("triton rope", lambda: rope(t, cos, sin, d)),
        4 * n,
        COPY,
        n,
        dev,
    )
