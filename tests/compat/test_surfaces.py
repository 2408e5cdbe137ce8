"""The compatibility surfaces the alias serves: amp._amp_state, apex_C, fused_adam_cuda,
fused_layer_norm_cuda, apex.normalization.fused_layer_norm's Function names, syncbn."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mpnb import amp
from mpnb.compat import amp_state, apex_C, fused_adam_cuda, fused_layer_norm_cuda, syncbn
from mpnb.compat import fused_layer_norm as fln


def _initialized(**kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, verbosity=0, **kw)
    return model, opt


# ---- amp._amp_state --------------------------------------------------------------------------


def test_amp_state_is_a_view_onto_the_latest_handle():
    model, opt = _initialized(opt_level="O2", loss_scale="dynamic", num_losses=2)
    handle = amp.current_handle()
    state = amp_state._amp_state
    assert state.handle is handle and state.opt_properties is handle.properties
    assert state.opt_properties.opt_level == "O2" and amp_state.opt_properties.opt_level == "O2"
    views = state.loss_scalers
    assert len(views) == 2 and views[0].dynamic is True
    assert views[0].loss_scale() == views[0]._loss_scale == handle.scalers[0].loss_scale()
    assert views[0]._scale_seq_len == handle.scalers[0].scale_window
    # a step that overflows halves the real scale: the view shows it (it is not a copy)
    before = views[0].loss_scale()
    x = torch.randn(2, 4).to(next(model.parameters()).dtype)
    loss = model(x).float().sum() * float("inf")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()  # skipped: the gradients are not finite
    assert views[0].loss_scale() == before / 2 == handle.scalers[0].loss_scale()


def test_amp_state_writes_are_refused_except_the_loss_scale_apex_recipes_set():
    _initialized(opt_level="O1")
    state, handle = amp_state._amp_state, amp.current_handle()
    with pytest.raises(AttributeError, match="read-only.*amp.initialize"):
        state.loss_scalers = []
    with pytest.raises(AttributeError, match="read-only"):
        state.loss_scalers[0].dynamic = False
    # NVIDIA's BERT recipe: amp._amp_state.loss_scalers[0]._loss_scale = 2**20
    state.loss_scalers[0]._loss_scale = 2.0**20
    assert handle.scalers[0].loss_scale() == 2.0**20
    assert float(handle.scalers[0].inv_scale) == 2.0**-20  # through the scaler's own API


def test_amp_state_before_initialize_is_an_attribute_error(monkeypatch):
    def never():
        raise ValueError("amp.initialize has not been called yet")

    monkeypatch.setattr(amp_state, "current_handle", never)
    assert not hasattr(amp_state._amp_state, "loss_scalers")  # as Apex's object before init
    with pytest.raises(AttributeError, match="initialize"):
        amp_state.loss_scalers  # noqa: B018


# ---- apex_C ----------------------------------------------------------------------------------


def test_apex_c_flatten_unflatten_round_trip():
    ts = [torch.randn(2, 3), torch.randn(5), torch.randn(1, 1, 4)]
    flat = apex_C.flatten(ts)
    assert flat.shape == (6 + 5 + 4,)
    back = apex_C.unflatten(flat, ts)
    assert all(torch.equal(a, b) for a, b in zip(back, ts, strict=True))


# ---- fused_adam_cuda -------------------------------------------------------------------------


def _apex_kernel(p, m, v, g, lr, b1, b2, eps, scale, step, mode, bc, decay):
    """Apex's fused_adam_cuda kernel, element by element in Python floats."""
    size = lr * math.sqrt(1 - b2**step) / (1 - b1**step) if bc else lr
    out = []
    for pi, mi, vi, gi in zip(p, m, v, g, strict=True):
        gi = gi / scale
        mi = b1 * mi + (1 - b1) * gi
        vi = b2 * vi + (1 - b2) * gi * gi
        denom = math.sqrt(vi + eps) if mode == 0 else math.sqrt(vi) + eps
        out.append((pi - size * (mi / denom + decay * pi), mi, vi))
    return [list(col) for col in zip(*out, strict=True)]


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("bias_correction", [0, 1])
def test_fused_adam_cuda_adam_matches_apexs_kernel(mode, bias_correction):
    torch.manual_seed(1)
    p, m, v = torch.randn(7), torch.randn(7) * 0.1, torch.rand(7) * 0.01
    want = [p.tolist(), m.tolist(), v.tolist()]
    copy = torch.empty(7, dtype=torch.float16)
    for step in (1, 2, 3):
        g = (torch.randn(7) * 128).half()
        args = (1e-2, 0.9, 0.999, 1e-6, 128.0, step, mode, bias_correction, 0.01)
        want = _apex_kernel(*want, g.float().tolist(), *args)
        fused_adam_cuda.adam(p, copy, m, v, g, *args)
    for got, w in zip((p, m, v), want, strict=True):
        torch.testing.assert_close(got, torch.tensor(w), rtol=2e-6, atol=1e-7)
    assert torch.equal(copy, p.half())  # the fp16 model copy gets the new values


def test_fused_adam_cuda_approaches_torch_adam_as_eps_vanishes():
    """Without eps and decay, Apex's old kernel is Adam: compare with torch.optim.Adam."""
    torch.manual_seed(2)
    p = torch.randn(10)
    q = p.clone().requires_grad_()
    ref = torch.optim.Adam([q], lr=1e-3, eps=1e-30)
    m, v = torch.zeros(10), torch.zeros(10)
    for step in range(1, 4):
        g = torch.randn(10)
        q.grad = g.clone()
        ref.step()
        fused_adam_cuda.adam(
            p, torch.empty(0), m, v, g, 1e-3, 0.9, 0.999, 1e-30, 1.0, step, 1, 1, 0
        )
    torch.testing.assert_close(p, q.detach(), rtol=1e-6, atol=1e-7)


def test_fused_adam_cuda_adam_mt_honours_the_noop_flag_and_checks_its_lists():
    p, m, v, g = torch.ones(3), torch.zeros(3), torch.zeros(3), torch.ones(3)
    args = (1e-2, 0.9, 0.999, 1e-8, 1.0, 1, 1, 1, 0.0)
    fused_adam_cuda.adam_mt(2048, torch.ones(1, dtype=torch.int32), [[p], [m], [v], [g]], *args)
    assert torch.equal(p, torch.ones(3))  # skipped
    fused_adam_cuda.adam_mt(2048, torch.zeros(1, dtype=torch.int32), [[p], [m], [v], [g]], *args)
    assert (p < 1).all()
    with pytest.raises(ValueError, match="4 or 5 tensor lists"):
        fused_adam_cuda.adam_mt(2048, torch.zeros(1), [[p], [m]], *args)
    with pytest.raises(ValueError, match="moments and gradient"):
        fused_adam_cuda.adam(p, torch.empty(0), m, v, torch.ones(4), *args)


# ---- fused_layer_norm_cuda and the Function names --------------------------------------------


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_fused_layer_norm_cuda_forward_backward_match_torch(memory_efficient):
    torch.manual_seed(3)
    x = torch.randn(6, 5, 8, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(5, 8, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(6, 5, 8, dtype=torch.float64)
    y_ref = F.layer_norm(x, (5, 8), w, b, 1e-5)
    y_ref.backward(dy)
    y, mean, invvar = fused_layer_norm_cuda.forward_affine(x, (5, 8), w, b, 1e-5)
    assert not y.requires_grad and mean.shape == (6,)  # an extension function: no autograd
    torch.testing.assert_close(y, y_ref.detach())
    saved = y if memory_efficient else x.detach()
    dx, dw, db = fused_layer_norm_cuda.backward_affine(
        dy, mean, invvar, saved, (5, 8), w, b, 1e-5, memory_efficient
    )
    for got, want in ((dx, x.grad), (dw, w.grad), (db, b.grad)):
        torch.testing.assert_close(got, want)
    # RMS norm, with and without a weight
    xr = x.detach().clone().requires_grad_()
    r_ref = F.rms_norm(xr, (5, 8), w.detach(), 1e-5)
    r_ref.backward(dy)
    r, inv = fused_layer_norm_cuda.rms_forward_affine(xr, (5, 8), w.detach(), 1e-5)
    torch.testing.assert_close(r, r_ref.detach())
    saved = r if memory_efficient else xr.detach()
    dxr, _ = fused_layer_norm_cuda.rms_backward_affine(
        dy, inv, saved, (5, 8), w.detach(), 1e-5, memory_efficient
    )
    torch.testing.assert_close(dxr, xr.grad)
    plain, inv0 = fused_layer_norm_cuda.rms_forward(x.detach(), 8, 1e-5)
    torch.testing.assert_close(plain, F.rms_norm(x.detach(), (8,), eps=1e-5))
    g0 = fused_layer_norm_cuda.rms_backward(dy, inv0, x.detach(), 8, 1e-5)
    assert g0.shape == x.shape


def test_function_names_apply_the_differentiable_ops():
    torch.manual_seed(4)
    x = torch.randn(4, 16, requires_grad=True)
    w, b = torch.rand(16, requires_grad=True), torch.randn(16, requires_grad=True)
    y = fln.FusedLayerNormAffineFunction.apply(x, w, b, (16,), 1e-5)
    y.sum().backward()
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    F.layer_norm(x2, (16,), w2, b2, 1e-5).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-5)
    r = fln.FusedRMSNormAffineFunction.apply(x.detach(), w.detach(), (16,), 1e-5)
    torch.testing.assert_close(r, F.rms_norm(x.detach(), (16,), w.detach(), 1e-5))
    half = x.detach().bfloat16()
    mixed = fln.FusedLayerNormAffineMixedDtypesFunction.apply(half, w, b, (16,), 1e-5)
    assert mixed.dtype == torch.bfloat16  # the input's dtype, as mpnb.normalization's
    plain = fln.FusedLayerNormFunction.apply(x.detach(), (16,), 1e-5)
    torch.testing.assert_close(plain, F.layer_norm(x.detach(), (16,), eps=1e-5))
    assert isinstance(fln.MixedFusedLayerNorm(16), torch.nn.Module)


# ---- syncbn ------------------------------------------------------------------------------------


@pytest.mark.parametrize("channel_last", [False, True])
def test_syncbn_kernels_chain_like_apexs_kernel_file(channel_last):
    """Apex's optimized SyncBN sequence on two 'ranks' (halves of one batch, merged with
    welford_parallel) equals F.batch_norm on the whole batch, forward and backward."""
    torch.manual_seed(5)
    x = torch.randn(8, 3, 4, 5, dtype=torch.float64)
    w, b = torch.rand(3, dtype=torch.float64) + 0.5, torch.randn(3, dtype=torch.float64)
    dy = torch.randn_like(x)
    xr = x.clone().requires_grad_()
    wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
    F.batch_norm(xr, None, None, wr, br, training=True, eps=1e-5).backward(dy)
    if channel_last:
        x, dy, xr_grad = (t.permute(0, 2, 3, 1).contiguous() for t in (x, dy, xr.grad))
        stats, fwd = syncbn.welford_mean_var_c_last, syncbn.batchnorm_forward_c_last
        red, bwd = syncbn.reduce_bn_c_last, syncbn.batchnorm_backward_c_last
    else:
        xr_grad = xr.grad
        stats, fwd, red, bwd = (
            syncbn.welford_mean_var,
            syncbn.batchnorm_forward,
            syncbn.reduce_bn,
            syncbn.batchnorm_backward,
        )
    halves = (x[:3], x[3:])
    parts = [stats(h) for h in halves]
    counts = torch.tensor([3 * 20, 5 * 20], dtype=torch.int32)
    mean, var, inv_std = syncbn.welford_parallel(
        torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), counts, 1e-5
    )
    torch.testing.assert_close(var, x.double().var((0, 1, 2) if channel_last else (0, 2, 3)))
    fwd_args = (None, mean, inv_std, w, b, False) if channel_last else (mean, inv_std, w, b)
    y = fwd(x, *fwd_args)
    want = F.batch_norm(xr.detach(), None, None, w, b, training=True, eps=1e-5)
    if channel_last:
        want = want.permute(0, 2, 3, 1)
    torch.testing.assert_close(y, want)
    sums = [red(dy[s], x[s], mean, inv_std, w) for s in (slice(0, 3), slice(3, 8))]
    sum_dy, sum_dy_xmu = sums[0][0] + sums[1][0], sums[0][1] + sums[1][1]
    grad_w = sums[0][2] + sums[1][2]
    dx = bwd(dy, x, mean, inv_std, w, sum_dy, sum_dy_xmu, counts)
    torch.testing.assert_close(dx, xr_grad)
    torch.testing.assert_close(grad_w, wr.grad)


def test_syncbn_relu_bw_c_last_masks_where_the_fused_relu_was_off():
    torch.manual_seed(6)
    x, z = torch.randn(6, 4), torch.randn(6, 4)
    mean, var = x.mean(0), x.var(0, unbiased=False)
    inv = torch.rsqrt(var + 1e-5)
    w, b = torch.ones(4), torch.zeros(4)
    y = syncbn.batchnorm_forward_c_last(x, z, mean, inv, w, b, True)
    g = syncbn.relu_bw_c_last(torch.ones(6, 4), x, z, mean, inv, w, b)
    assert torch.equal(g, (y > 0).float())
