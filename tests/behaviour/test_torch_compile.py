"""A small transformer block built from mpnb's fused layers runs under torch.compile (the ops
are traced through their fake kernels, the backward through their registered autograd)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpnb.normalization import FusedLayerNorm, FusedRMSNorm
from mpnb.transformer import AttnMaskType
from mpnb.transformer.functional import FusedScaleMaskSoftmax, fused_apply_rotary_pos_emb


class Block(nn.Module):
    """Pre-norm causal attention with RoPE, and an RMS-normed MLP."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.dh = heads, d // heads
        self.ln = FusedLayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.softmax = FusedScaleMaskSoftmax(
            False, False, AttnMaskType.causal, True, None, True, self.dh**-0.5
        )
        self.rms = FusedRMSNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        s, b, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(s, b, 3 * self.heads, self.dh).chunk(3, dim=2)
        q, k = fused_apply_rotary_pos_emb(q, freqs), fused_apply_rotary_pos_emb(k, freqs)
        scores = torch.einsum("sbhd,tbhd->bhst", q, k)
        probs = self.softmax(scores, None)
        x = x + torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(s, b, d)
        return x + self.mlp(self.rms(x))


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compiled_block_matches_eager(kernels, backend):
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(16, 2, 32, requires_grad=True)
    f = torch.arange(16.0)[:, None] / 10000 ** (torch.arange(0, 8, 2) / 8)
    freqs = torch.cat([f, f], -1)[:, None, None, :]
    eager = block(x, freqs)
    (ge,) = torch.autograd.grad(eager.sum(), x)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend)
    out = compiled(x, freqs)
    (gc,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-5)
    if kernels:
        explain = torch._dynamo.explain(block)(x, freqs)
        assert explain.graph_break_count == 0, explain.break_reasons
