"""``mpnb.lab._train``: one loop trains every configuration (the peers too), host syncs per
step, the row's warnings and its divergence advice, any output type handed to ``loss_fn``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

import mpnb.lab
from mpnb.core.optimizers import FusedAdam, FusedSGD
from mpnb.core.precision_configs import (
    make_optimizer,
)
from mpnb.lab import workloads
from mpnb.lab.config import expand
from tests.lab.test_runner import _data, _tiny
from tests.lab.test_runner import _tiny_workload as _workload


@pytest.fixture(scope="module")
def df():
    return mpnb.lab.compare(
        _workload(),
        configs=("O0", "O1", "O2", "torch-amp", "tf32"),
        half_dtype=("bf16", "fp16"),
        steps=14,
        optimizer="fused_adam",
        progress=False,
        threads=1,
    )


def test_the_peers_are_rows_of_the_same_round_robin(df):
    rows = df.set_index("configuration")
    amp_bf16, amp_fp16 = rows.loc["torch-amp bf16 b16"], rows.loc["torch-amp fp16 b16"]
    assert amp_bf16.status == amp_fp16.status == "ok", (amp_bf16.error, amp_fp16.error)
    hist = df.attrs["history"]
    first = hist[hist.step == 0].set_index("configuration")["loss"]
    # the same seed, model and batch: autocast's first loss is O1's, bit for bit, and the fp32
    # reference's within bf16's rounding
    assert first["torch-amp bf16 b16"] == first["O1 bf16 b16"]
    assert first["torch-amp fp16 b16"] == first["O1 fp16 b16"]
    assert first["torch-amp bf16 b16"] == pytest.approx(first["O0 fp32 b16"], rel=1e-2)
    assert (hist.groupby("configuration").size() == 14).all()  # all of them, every round
    assert amp_bf16.rounds == amp_fp16.rounds == rows.loc["O2 bf16 b16"].rounds > 0
    assert math.isfinite(amp_bf16.speedup_vs_O0) and amp_bf16.output_diff_vs_O0 > 0
    assert "torch.optim.AdamW(" in amp_bf16.warnings and "fused=True" in amp_bf16.warnings
    assert "weight_decay=0.0)" in amp_bf16.warnings
    # GradScaler on for fp16 (its default scale, no overflow here), off for bf16
    assert amp_fp16.final_loss_scale == 2.0**16 and amp_bf16.final_loss_scale == 1.0
    assert amp_fp16.skipped_steps == amp_bf16.skipped_steps == 0


def test_host_syncs_per_step_is_what_the_counter_says(df):
    rows = df.set_index("configuration")
    peers = rows.loc[["torch-amp bf16 b16", "torch-amp fp16 b16"], "host_syncs_per_step"]
    assert (peers == 0).all()
    ok = df[df.status == "ok"]
    assert ok.host_syncs_per_step.notna().all() and (ok.host_syncs_per_step >= 0).all()

    def reading_loss(out, y):  # a training step that reads the host once: its loss_fn's .item()
        loss = nn.functional.cross_entropy(out, y)
        loss.item()
        return loss

    w = workloads.custom(_tiny, _data(), reading_loss, batch_size=16)
    one = mpnb.lab.compare(w, configs=("O0", "torch-amp"), half_dtype="bf16", steps=6)
    # the step's own read, counted once: not the lab's bookkeeping (its log, its evaluation)
    assert one.set_index("opt_level").loc["torch-amp", "host_syncs_per_step"] == 1


def test_tf32_is_an_honest_unsupported_row_on_a_cpu(df):
    r = df.set_index("configuration").loc["tf32 b16"]
    assert r.status == "unsupported" and r.precision == "tf32 (unsupported)"
    assert "CUDA" in r.error and "no TF32" in r.error and r.steps_done == 0
    assert math.isnan(r.speedup_vs_O0) and "unsupported" in r.speed_label
    assert "torch.backends.cuda.matmul" in r.snippet  # the way to run it where it exists
    assert f"Not run: {r.error}." in df.attrs["verdict"]["text"]
    assert torch.get_float32_matmul_precision() == "highest"  # nothing left switched on


def test_the_verdict_compares_mpnb_best_with_torch_amp(df):
    v = df.attrs["verdict"]["versus_reference"]
    assert v is not None and v["reference"].startswith("torch-amp")
    assert v["mpnb"] in set(df.configuration) and not v["mpnb"].startswith(("O0", "torch"))
    assert v["text"] in df.attrs["verdict"]["text"] and "mpnb's best" in v["text"]
    assert v["rounds"] > 0


class _Overflow(nn.Module):
    """Logits far above fp16's range: every fp16 step overflows and is skipped."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        return self.lin(x) * 1e6


def test_a_row_whose_every_step_was_skipped_says_so():
    w = workloads.custom(_Overflow, _data(), nn.functional.cross_entropy, batch_size=16)
    df = mpnb.lab.compare(
        w, opt_levels=("O0", "O2"), half_dtype="fp16", steps=4, progress=False, threads=1
    ).set_index("opt_level")
    assert df.loc["O2", "skipped_steps"] == 4
    assert "every one of the 4 steps" in df.loc["O2", "warnings"]
    assert "was skipped" in df.loc["O2", "warnings"]
    assert "trace_overflow" in df.loc["O2", "warnings"]
    assert "skipped" not in df.loc["O0", "warnings"]


def _cfg(level, half):
    dtype = "bf16" if half == "fp32" else half  # O0 runs fp32 whatever the half dtype
    return next(
        c
        for c in expand("mlp", (level,), dtype, (16,), 4, "adam", None, None, "cpu", 0)
        if c.half_dtype == half
    )


def test_the_nan_divergence_advice_fits_the_row():
    from mpnb.lab._train import divergence_message

    fp32 = divergence_message(_cfg("O0", "fp32"), float("nan"), 3, False, 1.0)
    assert "not a precision problem" in fp32 and "loss scal" not in fp32 and "bf16" not in fp32
    bf16 = divergence_message(_cfg("O2", "bf16"), float("nan"), 3, False, 1.0)
    assert "loss scaling would not help" in bf16 and "use dynamic" not in bf16
    static = divergence_message(_cfg("O2", "fp16"), float("inf"), 3, False, 128.0)
    assert "use dynamic loss scaling" in static and "or bf16" in static
    dynamic = divergence_message(_cfg("O2", "fp16"), float("nan"), 3, True, 128.0)
    assert "use dynamic" not in dynamic and "dynamic loss scale 128" in dynamic
    o3 = divergence_message(_cfg("O3", "bf16"), float("nan"), 3, False, 1.0)
    assert "O2 keeps them in fp32" in o3


@pytest.mark.parametrize(
    "name, cls, mode",
    [("adam", FusedAdam, "adam"), ("adamw", FusedAdam, "adamw"), ("sgd", FusedSGD, "sgd")],
)
@pytest.mark.parametrize("option", ["stochastic_rounding", "kahan_summation"])
def test_option_configs_get_the_fused_optimizer_of_the_same_rule(name, cls, mode, option):
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = make_optimizer(name, [p], 1e-3, option)
    assert type(opt) is cls and opt.defaults[option] is True
    if mode == "adamw":
        assert opt.defaults["weight_decay"] == 1e-2  # torch.optim.AdamW's default
    if mode == "sgd":
        assert opt.defaults["momentum"] == 0.9
    assert type(make_optimizer(name, [p], 1e-3)).__module__.startswith("torch.optim")


def test_a_rows_layer_fallback_notes_are_said_once_per_recipe_and_cause():
    import warnings

    from mpnb.core.fp8 import Float8FallbackWarning, convert_to_float8_training
    from mpnb.lab._train import row_warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    convert_to_float8_training(model, "nvfp4")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(4, 32)).sum().backward()
        warnings.warn("another warning. With a second sentence.", UserWarning, stacklevel=1)
    fell = [c for c in caught if issubclass(c.category, Float8FallbackWarning)]
    assert {c.message.layer for c in fell} == {str(i) for i in range(6)}  # one per layer
    notes = row_warnings(caught)
    layer_notes = [n for n in notes if n.startswith("mpnb.fp8:")]
    cause = fell[0].message.cause.split(". ")[0]  # a note is the first sentence
    assert layer_notes == [f"mpnb.fp8: 6 layers (0, 1, ..., 5) {cause}"]
    assert notes[-1] == "another warning"  # others keep their first sentence, in order
    one = row_warnings(fell[:1])
    assert one == [f"mpnb.fp8: layer '0' {cause}"]


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    aux: torch.Tensor


class _Multi(nn.Module):
    """Returns its logits as a tensor, tuple, dict or dataclass."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.lin = kind, nn.Linear(8, 3)

    def forward(self, x):
        z = self.lin(x)
        return {
            "tensor": z,
            "tuple": (z, z.sum()),
            "dict": {"logits": z, "aux": z.sum()},
            "dataclass": _Out(z, z.sum()),
        }[self.kind]


@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict", "dataclass"])
def test_output_types_reach_loss_fn_unchanged(kind):
    x = torch.randn(64, 8)
    y = x[:, :3].argmax(1)
    types = set()

    def loss_fn(out, target):
        types.add(type(out))
        return nn.functional.cross_entropy(workloads.logits_of(out).float(), target)

    df = mpnb.lab.compare(
        lambda: _Multi(kind),
        (x, y),
        loss_fn=loss_fn,
        metric_fn=workloads.accuracy,
        steps=3,
        progress=False,
        threads=1,
    )
    # every level hands loss_fn the model's own output type, casts applied inside it
    assert (df.status == "ok").all(), df.error.tolist()
    expected = {"tensor": torch.Tensor, "tuple": tuple, "dict": dict, "dataclass": _Out}[kind]
    assert types == {expected} and df.metric.notna().all()
