"""The layers suite: the RoPE cases (one per layout and direction, both candidates computing the
same rotation on the same tensor, mpnb's output laid out as its input, the compiled reference
beside them) and every kernel alone in fp32 and bf16 with its bytes, bandwidth target and
in-cache roofline."""

from __future__ import annotations

import torch

from mpnb.lab.bench import layers
from mpnb.lab.bench._harness import Options


def test_rope_has_one_case_per_layout_and_its_candidates_agree(kernels):
    rope = [c for c in layers.cases(Options.make(quick=True, scale=0.004)) if "rope" in c.name]
    layouts = ("sbhd", "bshd", "bhsd", "bhsd view of bshd", "sbhd view of bhsd")
    want = [
        (f"rope {way} {x}", dt)
        for dt in ("float32", "bfloat16")
        for x in layouts
        for way in ("fwd", "bwd")
    ]
    assert [(c.name, c.workload.split()[-1]) for c in rope] == want
    for case in rope:
        torch_ops, mpnb_rope, compiled_ref, floor = case.candidates
        assert floor.bytes == 2 * floor.fn().numel() * floor.fn().element_size()
        assert compiled_ref.compiled and compiled_ref.name == "torch.compile(reference_rope)"
        want, got = torch_ops.fn(), mpnb_rope.fn()
        assert got.shape == want.shape and got.stride() == want.stride(), case.label
        bf16 = got.dtype == torch.bfloat16
        tol = dict(rtol=1.6e-2, atol=1.6e-2) if bf16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, **tol, msg=case.label)
        assert mpnb_rope.bytes == 2 * got.numel() * got.element_size() + 2 * 8 * 128 * 4
        assert mpnb_rope.in_cache is not None and mpnb_rope.bw_target == 0.7


_KERNELS = (
    "layer_norm fwd",
    "layer_norm bwd",
    "rms_norm fwd",
    "rms_norm bwd",
    "scaled_softmax fwd",
    "scaled_masked_softmax fwd",
    "scaled_softmax bwd",
    "causal softmax fwd",
    "causal softmax bwd",
)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def test_every_kernel_alone_in_fp32_and_bf16_has_bytes_bandwidth_and_roofline(kernels):
    cases = [
        c
        for c in layers.cases(Options.make(quick=True, scale=0.002))
        if c.name in _KERNELS and "1024)" in c.workload
    ]
    got = sorted((c.name, c.workload.split()[-1]) for c in cases)
    assert got == sorted((k, dt) for k in _KERNELS for dt in ("float32", "bfloat16"))
    for case in cases:
        torch_cand, mpnb_cand, compiled_ref, floor = case.candidates
        assert floor.name == "floor: x.clone() (fresh output)"
        assert floor.fn().shape == _first(mpnb_cand.fn()).shape, case.label
        assert compiled_ref.compiled and not torch_cand.bytes
        assert mpnb_cand.bw_target == 0.7 and case.bandwidth_numel > 0, case.label
        roof = mpnb_cand.in_cache
        assert 0 < roof.small_bytes < roof.bytes <= mpnb_cand.bytes, case.label
        # the slices run the same kernel: their output is the full output's first rows
        full, part = _first(mpnb_cand.fn()), _first(roof.small_fn())
        assert part.dtype == full.dtype and part.numel() < full.numel(), case.label
        if "causal" not in case.name:  # causal slices are leading square blocks instead
            rows = full.reshape(-1, full.shape[-1])[: part.numel() // full.shape[-1]]
            assert torch.equal(part.reshape(rows.shape), rows), case.label


def test_kernel_bytes_are_the_least_traffic(kernels):
    by_name = {
        (c.name, c.workload.split()[-1]): c
        for c in layers.cases(Options.make(quick=True, scale=0.002))
        if c.name in _KERNELS and "1024)" in c.workload
    }
    ln = by_name[("layer_norm fwd", "bfloat16")]
    rows = ln.bandwidth_numel // 1024
    assert ln.candidates[1].bytes == rows * (2 * 1024 * 2 + 8)  # x, y, mean and rstd
    rms = by_name[("rms_norm bwd", "float32")]
    assert rms.candidates[1].bytes == rows * (3 * 1024 * 4 + 4)  # dy, x, dx and rstd
    n = by_name[("scaled_softmax bwd", "bfloat16")].bandwidth_numel
    assert by_name[("scaled_softmax bwd", "bfloat16")].candidates[1].bytes == 3 * n * 2
    masked = by_name[("scaled_masked_softmax fwd", "bfloat16")]
    assert masked.candidates[1].bytes == 2 * n * 2 + 2 * 1024 * 1024  # + the [2, 1, sq, sk] mask
    causal = by_name[("causal softmax fwd", "float32")]
    sq = 1024
    batches = causal.bandwidth_numel // (sq * sq)
    assert causal.candidates[1].bytes == batches * 4 * (sq * (sq + 1) // 2 + sq * sq)


def test_no_roofline_where_the_l2_size_is_not_known(kernels, monkeypatch):
    from mpnb.lab.bench import _harness

    monkeypatch.setattr(_harness, "l2_bytes", lambda: None)
    cases = [c for c in layers.cases(Options.make(quick=True, scale=0.002)) if c.name in _KERNELS]
    assert cases and all(c.candidates[1].in_cache is None for c in cases)
    assert all(c.candidates[1].bw_target == 0.7 for c in cases)  # the bandwidth rows stay


def test_every_scalar_reaches_mpnbs_ops_by_keyword(kernels, monkeypatch):
    from types import SimpleNamespace

    from mpnb.core import ops

    calls = []

    def recorded(name):
        op = getattr(ops, name)

        def call(*args, **kwargs):
            calls.append((name, args))
            return op(*args, **kwargs)

        return call

    names = [n for n in dir(ops) if not n.startswith("_") and callable(getattr(ops, n))]
    monkeypatch.setattr(layers, "ops", SimpleNamespace(**{n: recorded(n) for n in names}))
    for case in layers.cases(Options.make(quick=True, scale=0.002)):
        mpnb_cand = case.candidates[1]
        mpnb_cand.fn()
        if mpnb_cand.in_cache is not None:
            mpnb_cand.in_cache.small_fn()
    assert {name for name, _ in calls} >= {"layer_norm_bwd", "rope", "scaled_softmax_bwd"}
    positional = [(n, a) for n, args in calls for a in args if isinstance(a, (int, float, str))]
    assert positional == []  # bools are ints: a flag passed by position fails too
