"""Bad input meets a clear error and loses nothing (amp's side of "Nothing lost, nothing silent").

Loss scales that are not positive finite numbers, corrupt ``amp.load_state_dict`` entries
(all or nothing), consistent skipping with a static scale, the collapse message, and inputs
refused where they enter (a Python float loss, a meta model, complex params, a recast model).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from mpnb import amp
from mpnb.core.amp import LossScaleCollapseError, LossScaler
from mpnb.optimizers import FusedSGD


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


def _init(level="O2", opt_cls=torch.optim.SGD, **kw):
    m = _net()
    opt = opt_cls(m.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return amp.initialize(m, opt, opt_level=level, verbosity=0, half_dtype=torch.bfloat16, **kw)


def _step(m, opt, scale_by=1.0, **kw):
    opt.zero_grad()
    with amp.scale_loss(m(torch.randn(3, 4)).float().pow(2).mean() * scale_by, opt, **kw) as s:
        s.backward()
    opt.step()


# ---- 16.3: a loss scale that is not a positive finite number is refused ---------------------


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(loss_scale=math.inf), "loss_scale"),
        (dict(loss_scale=0), "loss_scale"),
        (dict(loss_scale=-2.0), "loss_scale"),
        (dict(loss_scale=math.nan), "loss_scale"),
        (dict(max_loss_scale=0.0), "max_loss_scale"),
        (dict(max_loss_scale=-1.0), "max_loss_scale"),
        (dict(max_loss_scale=math.inf), "max_loss_scale"),
        (dict(min_loss_scale=math.nan), "min_loss_scale"),
        (dict(min_loss_scale=2.0**20, max_loss_scale=2.0**10), "min_loss_scale"),
    ],
)
def test_initialize_refuses_a_bad_loss_scale_naming_the_argument(kw, name):
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=name):  # fp16: the dynamic scale is the default
        amp.initialize(m, opt, opt_level="O1", half_dtype=torch.float16, verbosity=0, **kw)


@pytest.mark.parametrize(
    "key, value",
    [
        ("loss_scale", 0.0),
        ("loss_scale", -4.0),
        ("loss_scale", math.inf),
        ("loss_scale", math.nan),
        ("loss_scale", None),
        ("loss_scale", [65536.0]),
        ("loss_scale", "65536"),
        ("unskipped", 2**40),
        ("unskipped", -1),
        ("unskipped", None),
        ("unskipped", "3"),
    ],
)
def test_load_state_dict_refuses_a_corrupt_entry_naming_the_key(key, value):
    m, opt = _init()
    _step(m, opt)
    before = amp.state_dict()
    bad = amp.state_dict()
    bad["loss_scaler0"][key] = value
    with pytest.raises(ValueError, match=f"loss_scaler0.*{key}"):
        amp.load_state_dict(bad)
    assert amp.state_dict() == before


def test_the_scale_never_reaches_zero_or_inf():
    s = LossScaler("dynamic", max_skips_at_min=None)
    g = [torch.tensor([1.0, math.inf])]
    for _ in range(400):  # far more backoffs than fp32 has exponents
        s.clear_overflow()
        s.unscale(g, g)
        s.update()
    assert s.loss_scale() > 0 and math.isfinite(s.inv_scale.item())


# ---- 16.4: amp.load_state_dict is all or nothing ----------------------------------------------


def test_amp_load_state_dict_changes_nothing_when_one_scaler_is_bad():
    m, opt = _init(num_losses=2)
    _step(m, opt, scale_by=math.inf, loss_id=0)
    before = amp.state_dict()
    state = {
        "loss_scaler0": {"loss_scale": 8.0, "unskipped": 1},
        "loss_scaler1": {"loss_scale": -1.0, "unskipped": 0},
    }
    with pytest.raises(ValueError, match="loss_scaler1"):
        amp.load_state_dict(state)
    assert amp.state_dict() == before  # the first scaler was not overwritten


# ---- 16.7: consistent skipping, the collapse message ------------------------------------------


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, FusedSGD])
def test_a_static_scale_steps_through_inf_with_a_warning_for_every_optimizer_kind(opt_cls):
    """Apex's rule for a static scale (O3's default): the step is not skipped; amp warns."""
    m, opt = _init("O3", opt_cls)
    with pytest.warns(UserWarning, match="static loss scale.*not skipped"):
        _step(m, opt, scale_by=math.inf)
    assert not torch.isfinite(m[0].weight).all()  # as with Apex, whatever the optimizer


def test_the_collapse_message_fits_the_run():
    m, opt = _init("O2", min_loss_scale=4.0, loss_scale="dynamic")
    amp.current_handle().scalers[0].max_skips_at_min = 3
    with pytest.raises(LossScaleCollapseError) as e:
        for _ in range(40):
            _step(m, opt, scale_by=math.nan)
    msg = str(e.value)
    assert "at or below 4 (min_loss_scale" in msg  # the real floor
    assert "bfloat16" not in msg  # it runs bf16 already
    assert "max_skips_at_min=None" in msg and "min_loss_scale=" in msg
    amp.LossScaleRule(max_skips_at_min=None)  # the advised argument exists


def test_the_collapse_message_suggests_bf16_only_to_fp16_runs():
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, opt = amp.initialize(m, opt, opt_level="O1", half_dtype=torch.float16, verbosity=0)
    amp.current_handle().scalers[0].max_skips_at_min = 2
    with pytest.raises(LossScaleCollapseError, match="at or below 1 .*half_dtype=torch.bfloat16"):
        for _ in range(40):
            _step(m, opt, scale_by=math.nan)


# ---- 16.8: inputs checked where they enter --------------------------------------------------


def test_a_python_float_loss_gets_a_clear_error():
    m, opt = _init("O1")
    with pytest.raises(TypeError, match="loss must be a torch.Tensor.*loss.item"):
        with amp.scale_loss(1.5, opt):
            pass
    _step(m, opt)  # nothing was left half-open


def test_a_meta_model_is_refused_at_initialize():
    with torch.device("meta"):
        m = _net()
    with pytest.raises(ValueError, match="meta device.*to_empty"):
        amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), opt_level="O2", verbosity=0)


def test_complex_parameters_are_refused_at_initialize():
    m = torch.nn.Linear(4, 4, dtype=torch.complex64)
    with pytest.raises(ValueError, match="complex64.*view_as_real"):
        amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), opt_level="O1", verbosity=0)


@pytest.mark.parametrize("dtype", [torch.float64])  # a half model is refused (test_initialize)
def test_a_model_recast_to_bf16_by_o2_warns_once(dtype):
    m = _net().to(dtype)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        amp.initialize(m, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    msgs = [str(r.message) for r in rec if "recast" in str(r.message)]
    assert len(msgs) == 1 and str(dtype).split(".")[-1] in msgs[0]
    assert m[0].weight.dtype == torch.bfloat16
