"""Each configuration owns its training step (mpnb.core.precision_configs.TrainStep): one loop
trains them all; the peers' steps read nothing on the host; global TF32 state is restored."""

import pytest
import torch

from mpnb.core.amp import LossScaleRule
from mpnb.core.precision_configs import (
    PRECISION_CONFIGS,
    AmpStep,
    TrainStep,
    config_names,
    get_config,
    tf32_enabled,
)
from mpnb.lab.host_reads import HostReads

#: every configuration but the compiled one (a compile takes tens of seconds: tests/lab) and the
#: captured ones (CUDA graphs: test_graphed.py)
EAGER = [n for n in config_names() if n != "torch-amp+compile" and "+graph" not in n]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _loop(step, x, y):
    step.zero_grad()
    with step.forward_context():
        loss = torch.nn.functional.cross_entropy(step.model(x), y)
    step.backward(loss)
    step.step()
    return loss.detach()


@pytest.mark.parametrize("name", EAGER)
def test_one_loop_trains_every_configuration_through_its_step(name):
    cfg = get_config(name)
    model = _model()
    opt = cfg.make_optimizer("sgd", model.parameters(), 0.1)
    step = cfg.train_step(model, opt, half_dtype=torch.bfloat16)
    before = [p.detach().clone() for p in step.module.parameters()]
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    loss = _loop(step, x, y)  # tf32's step sets its flags inside and restores them
    assert isinstance(step, TrainStep) and torch.isfinite(loss)
    after = list(step.module.parameters())
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, after, strict=True))
    for t in (step.found_inf, step.scale):  # device tensors of one element, nobody read them
        assert t.shape == (1,) and t.dtype == torch.float32 and t.device.type == "cpu"
    assert isinstance(step, AmpStep) is not cfg.peer  # mpnb's all go through amp.scale_loss
    step.close()
    step.close()  # idempotent


def test_mpnb_steps_go_through_amp_scale_loss_exactly_as_before():
    from mpnb import amp

    cfg = PRECISION_CONFIGS["O2"]
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    model = _model()
    step = cfg.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.bfloat16)
    got = _loop(step, x, y)
    ref_model = _model()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ref_model, ref_opt = amp.initialize(ref_model, ref_opt, opt_level="O2", half_dtype="bf16")
    ref_opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(ref_model(x), y)
    with amp.scale_loss(loss, ref_opt) as scaled:
        scaled.backward()
    ref_opt.step()
    assert torch.equal(got, loss.detach())
    for a, b in zip(step.module.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)  # bit for bit: the same calls in the same order
    assert step.scale is step.scaler.scale and step.skips == step.scaler.dynamic


@pytest.mark.parametrize("half, scaled", [(torch.float16, True), (torch.bfloat16, False)])
def test_torch_amp_reads_nothing_on_the_host_and_scales_fp16_only(half, scaled):
    cfg = PRECISION_CONFIGS["torch-amp"]
    model = _model()
    opt = cfg.make_optimizer("adam", model.parameters(), 1e-3)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True
    step = cfg.train_step(model, opt, half_dtype=half)
    assert step.skips is scaled and step.grad_scaler.is_enabled() is scaled
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    for i in range(4):
        with HostReads() as reads:
            _loop(step, x, y)
        assert reads.count == 0, (i, reads.where)
    assert step.scale.item() == (2.0**16 if scaled else 1.0)


def test_a_torch_amp_skip_is_seen_on_the_device_and_is_real():
    cfg = PRECISION_CONFIGS["torch-amp"]
    model = _model()
    opt = cfg.make_optimizer("adam", model.parameters(), 1e-3)
    rule = LossScaleRule(init_scale=2.0**24, backoff_factor=0.5, growth_interval=1000)
    step = cfg.train_step(model, opt, half_dtype=torch.float16, loss_scale=rule)
    x, y = torch.randn(16, 8) * 100, torch.randint(0, 2, (16,))
    before = [p.detach().clone() for p in model.parameters()]
    _loop(step, x, y)  # 2**24 overflows the fp16 logits' gradient: the step is skipped
    assert step.found_inf.item() == 1.0 and step.scale.item() == 2.0**23
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert opt.state[model[0].weight]["step"].item() == 0  # the fused step did not count
    with pytest.raises(ValueError, match="no static scale"):
        cfg.train_step(_model(), opt, torch.float16, LossScaleRule.static(128.0))


def test_tf32_flags_are_restored_even_when_the_body_raises():
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = (matmul.fp32_precision, conv.fp32_precision)
    legacy = torch.get_float32_matmul_precision()
    with pytest.raises(RuntimeError, match="planted"):
        with tf32_enabled():
            assert matmul.fp32_precision == conv.fp32_precision == "tf32"
            raise RuntimeError("planted")
    assert (matmul.fp32_precision, conv.fp32_precision) == before
    cfg = PRECISION_CONFIGS["tf32"]
    assert "CUDA" in cfg.unavailable("cpu") and cfg.status("tf32", {"device": "cpu"})
    model = _model()
    step = cfg.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="planted"):
        with step.forward_context():
            raise RuntimeError("planted")
    assert (matmul.fp32_precision, conv.fp32_precision) == before
    # the legacy getters work again after (PyTorch refuses them while the new API's TF32 is on)
    assert torch.get_float32_matmul_precision() == legacy and not matmul.allow_tf32
