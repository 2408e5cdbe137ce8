"""A small attention block trained through every Triton kernel, against the same training
through the dispatcher's CPU kernels.

The op tests give each launcher the arguments a test writes; the layers and the optimizers
write their own (Apex-shaped RoPE frequencies, masks shared by the heads, causal scores, the
backward ops that autograd calls, optimizer lists without momentum). On a GPU
any of those calls can reach a Triton kernel, by the measured table or ``MPNB_TRITON=1``. Here
every launcher is registered as the ``mpnb`` ops' kernel for the test (the CPU's, run by
Triton's interpreter; on a GPU the CUDA one, compiled), so the whole training step runs through
them, and the result is compared with the same steps on the CPU through the C++ kernels (or the
references without them).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from .triton_cases import triton_as_kernels

F32, BF16 = torch.float32, torch.bfloat16
S, B, H, D = 8, 2, 2, 16  # sequence, batch, heads, head size
#: launchers every case below must reach (the optimizer's own are checked per case)
LAYER_OPS = {
    "layer_norm_fwd",
    "layer_norm_bwd",
    "rms_norm_fwd",
    "rms_norm_bwd",
    "rope",
    "scaled_masked_softmax_fwd",
    "scaled_upper_triang_masked_softmax_fwd",
    "scaled_softmax_bwd",
}


class Block(nn.Module):
    """LayerNorm, RoPE on q and k, causal and padding-masked fused softmax, RMSNorm."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        from mpnb.normalization import FusedLayerNorm, FusedRMSNorm

        d = H * D
        self.ln = FusedLayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.rms = FusedRMSNorm(d)
        self.to(dtype)
        pos = torch.arange(S, dtype=F32)[:, None] / 10000 ** (torch.arange(0, D, 2) / D)
        self.register_buffer("freqs", torch.cat([pos, pos], -1)[:, None, None, :])  # [s,1,1,d]
        pad = torch.zeros(B, 1, S, S, dtype=torch.bool)
        pad[1, :, :, S - 3 :] = True  # the second sequence's last 3 keys are padding
        self.register_buffer("pad", pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [s, b, h*d]
        from mpnb.transformer.functional import (
            fused_apply_rotary_pos_emb,
            scaled_masked_softmax,
            scaled_upper_triang_masked_softmax,
        )

        q, k, v = self.qkv(self.ln(x)).view(S, B, H, 3 * D).split(D, -1)
        q = fused_apply_rotary_pos_emb(q, self.freqs)
        k = fused_apply_rotary_pos_emb(k, self.freqs)
        scores = torch.einsum("sbhd,tbhd->bhst", q, k)  # [b, h, sq, sk]
        causal = scaled_upper_triang_masked_softmax(scores.reshape(B * H, S, S), D**-0.5)
        masked = scaled_masked_softmax(scores, self.pad, D**-0.5)
        probs = (causal.view(B, H, S, S) + masked) / 2
        ctx = torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(S, B, H * D)
        return self.rms(self.out(ctx) + x)


CASES = [
    ("FusedAdam", F32, dict(lr=1e-2, weight_decay=0.01), {"fused_adam_"}),
    ("FusedAdam", BF16, dict(lr=1e-2, stochastic_rounding=True), {"fused_adam_bf16_"}),
    ("FusedSGD", F32, dict(lr=0.1), {"fused_sgd_"}),  # no momentum: no first_run flags
    ("FusedSGD", BF16, dict(lr=0.1, momentum=0.9), {"fused_sgd_"}),
    ("FusedLAMB", F32, dict(lr=1e-2), {"fused_lamb_", "multi_tensor_l2norm"}),
    ("FusedLAMB", BF16, dict(lr=1e-2, kahan_summation=True), {"fused_lamb_bf16_"}),
]


def _train(cls_name: str, dtype, options: dict, device: str = "cpu", grads_of=None) -> tuple:
    """The block's losses, grads and params over two steps on a fixed batch. ``grads_of``:
    another run's grads, stepped on instead of this run's own (so that both runs' optimizers
    take the same inputs: Adam and LAMB normalize a grad, and one near 0 whose last bits differ
    moves its weight by up to lr either way)."""
    import mpnb.optimizers

    torch.manual_seed(0)
    model = Block(dtype).to(device)
    opt = getattr(mpnb.optimizers, cls_name)(
        model.parameters(), **options, generator=torch.Generator().manual_seed(1)
    )
    x = torch.randn(S, B, H * D, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    losses, grads = [], []
    for step in range(2):
        opt.zero_grad()
        loss = model(x).float().square().mean()
        loss.backward()
        losses.append(loss.detach().cpu())
        grads.append([p.grad.detach().to("cpu", copy=True) for p in model.parameters()])
        if grads_of is not None:
            for p, g in zip(model.parameters(), grads_of[step], strict=True):
                p.grad.copy_(g)
        opt.step()
    return losses, grads, [p.detach().to("cpu", copy=True) for p in model.parameters()]


def _case_id(value: object) -> str:
    """A test id that is the same in every process: a set's names sorted (xdist compares ids)."""
    return "+".join(sorted(value)) if isinstance(value, set) else str(value)


@pytest.mark.parametrize(("cls_name", "dtype", "options", "optimizer_ops"), CASES, ids=_case_id)
def test_training_through_triton_matches(cls_name, dtype, options, optimizer_ops, device):
    want = _train(cls_name, dtype, options)
    with triton_as_kernels(device) as called:
        got = _train(cls_name, dtype, options, device, grads_of=want[1])
    assert LAYER_OPS | optimizer_ops <= called, sorted((LAYER_OPS | optimizer_ops) - called)
    # forward and backward: a few ulps per op (fp32), a rounding of each output (bf16); the
    # grads at the scale of the largest (some cancel to nearly 0, where only that scale counts)
    rtol = 1e-4 if dtype == F32 else 2**-6
    torch.testing.assert_close(torch.stack(got[0]), torch.stack(want[0]), rtol=rtol, atol=0)
    for got_step, want_step in zip(got[1], want[1], strict=True):
        scale = max(float(w.abs().max()) for w in want_step)
        for g, w in zip(got_step, want_step, strict=True):
            torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * scale)
    # the steps, on the same grads: the kernels' tolerance against the references (fp32 to a
    # few ulps; a bf16 weight rounded, or stochastically drawn, from an fp32 value a few ulps
    # apart may land one bf16 ulp away)
    for g, w in zip(got[2], want[2], strict=True):
        if dtype == F32:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        else:
            ulp = torch.finfo(dtype).eps * w.float().abs().clamp_min(2**-100)
            assert ((g.float() - w.float()).abs() <= ulp).all()
            assert (g != w).float().mean() < 0.05  # the same bits almost everywhere
