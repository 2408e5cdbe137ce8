"""The layers suite's RoPE cases: one per layout, both candidates computing the same rotation
on the same tensor, mpnb's output laid out as its input, and the compiled reference beside them."""

from __future__ import annotations

import torch

from mpnb.lab.bench import layers
from mpnb.lab.bench._harness import Options


def test_rope_has_one_case_per_layout_and_its_candidates_agree(kernels):
    rope = [c for c in layers.cases(Options.make(quick=True, scale=0.004)) if "rope" in c.name]
    layouts = ("sbhd", "bshd", "bhsd", "bhsd view of bshd", "sbhd view of bhsd")
    want = [(f"rope fwd {x}", dt) for dt in ("float32", "bfloat16") for x in layouts]
    assert [(c.name, c.workload.split()[-1]) for c in rope] == want
    for case in rope:
        torch_ops, mpnb_rope, compiled_ref = case.candidates
        assert compiled_ref.compiled and compiled_ref.name == "torch.compile(reference_rope)"
        want, got = torch_ops.fn(), mpnb_rope.fn()
        assert got.shape == want.shape and got.stride() == want.stride(), case.label
        bf16 = got.dtype == torch.bfloat16
        tol = dict(rtol=1.6e-2, atol=1.6e-2) if bf16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, **tol, msg=case.label)
        assert mpnb_rope.bytes == 2 * got.numel() * got.element_size() + 2 * 8 * 128 * 4
