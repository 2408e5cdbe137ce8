"""What ``amp.initialize`` (and ``amp.init``'s handle) refuses, as Apex refuses it.

* A model already in half (fp16 or bf16 params or buffers) is refused at every opt level, as
  Apex's ``check_params_fp32`` refuses it (its ``allow_incoming_model_not_fp32`` escape is
  mpnb's ``cast_model_type=False``): under O1 such a model would train in half with no fp32
  copy, and updates below half's resolution would be lost.
* ``amp.init()``'s ``wrap_optimizer`` / ``scale_loss`` reach their message with any arguments.
* A model of another float dtype that O2 recasts to half warns once.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mpnb import amp

LEVELS = ("O0", "O1", "O2", "O3")


def _net(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).to(
        dtype
    )


def _init(model, level, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_model_is_refused_at_every_level(level, dtype):
    model = _net(dtype)
    with pytest.raises(ValueError, match="fp32 model") as e:
        _init(model, level, half_dtype=torch.bfloat16)
    assert "cast_model_type=False" in str(e.value)  # the deliberate way is named
    assert model[0].weight.dtype == dtype  # nothing was changed
    assert not getattr(model, "_amp_initialized", False)


def test_a_half_buffer_is_refused_too():
    model = _net()
    model.register_buffer("table", torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="'table'"):
        _init(model, "O1")


@pytest.mark.parametrize("level", LEVELS)
def test_cast_model_type_false_keeps_a_half_model_on_purpose(level):
    model, _ = _init(_net(torch.bfloat16), level, cast_model_type=False)
    assert model[0].weight.dtype == torch.bfloat16


def test_disabled_amp_takes_any_model():
    model, _ = _init(_net(torch.bfloat16), "O1", enabled=False)
    assert model[0].weight.dtype == torch.bfloat16


def test_an_fp32_model_still_goes_through():
    model, opt = _init(_net(), "O1", half_dtype=torch.bfloat16)
    assert model[0].weight.dtype == torch.float32


@pytest.mark.parametrize(
    "call",
    [
        lambda h, o: h.wrap_optimizer(o),
        lambda h, o: h.wrap_optimizer(o, num_loss=2),
        lambda h, o: h.scale_loss(torch.ones(()), o),
        lambda h, o: h.scale_loss(torch.ones(()), o, loss_id=1),
    ],
)
@pytest.mark.parametrize("enabled", [True, False])
def test_init_handle_loss_scaling_names_amp_initialize(call, enabled):
    opt = torch.optim.SGD(_net().parameters(), lr=0.1)
    with amp.init(enabled=enabled) as handle:
        with pytest.raises(RuntimeError, match="amp.initialize"):
            call(handle, opt)


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
