"""trace_precision: every op's module, phase, dtypes and the reason for its precision."""

import pytest
import torch
import torch.nn.functional as F

from mpnb import amp
from mpnb.lab import trace_precision
from mpnb.lab.precision_trace import COLUMNS, REASONS

M, K, H, N = 16, 64, 32, 10


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(K, H), torch.nn.ReLU(), torch.nn.Linear(H, N))


def _gemm_flops():
    """Forward and backward matmul FLOPs of the MLP (2*M*K*N per GEMM; dx and dW each)."""
    per = 2 * M * K * H + 2 * M * H * N
    return per + per + 2 * M * H * N  # forward, dW of both, dx of the second (x needs none)


def _rows(ops, **eq):
    sel = ops
    for k, v in eq.items():
        sel = sel[sel[k] == v]
    return sel


@pytest.fixture(scope="module")
def x():
    return torch.randn(M, K)


def test_o0_everything_float32(x):
    ops, summary = trace_precision(_mlp(), x, "O0")
    assert list(ops.columns) == COLUMNS
    assert set(ops["reason"]) <= set(REASONS)
    work = ops[ops["kind"] != "view"]
    assert set(work["dtype"]) == {"float32"}
    assert summary.by_dtype.set_index("dtype").loc["float32", "flops_share"] == 1.0
    assert summary.fp32_ops.empty  # O0 is not a half configuration
    assert summary.half_dtype == "-"


def test_o1_gemms_bf16_by_autocast_and_loss_float32(x):
    ops, summary = trace_precision(_mlp(), x, "O1", half_dtype=torch.bfloat16)
    fwd = _rows(ops, phase="forward", op="addmm")
    assert list(fwd["module"]) == ["0", "2"]
    assert set(fwd["dtype"]) == {"bfloat16"}
    assert set(fwd["reason"]) == {"autocast-lower-precision"}
    assert (fwd["api"] == "torch.nn.functional.linear").all()
    casts = _rows(ops, phase="forward", kind="cast")
    auto = casts[casts["reason"] == "autocast-cast"]
    assert len(auto) == 5  # x, W1, b1, W2, b2
    out = casts[casts["reason"] == "explicit-cast"]  # amp's O1 cast of the output to fp32
    assert len(out) == 1 and out["dtype"].item() == "float32" and len(casts) == 6
    relu = _rows(ops, phase="forward", op="relu")
    assert relu["dtype"].item() == "bfloat16" and relu["reason"].item() == "promotion"
    loss = _rows(ops, phase="loss")
    assert _rows(loss, op="mean")["dtype"].item() == "float32"
    assert _rows(loss, kind="cast").empty  # out.float() is a no-op: amp's output cast did it
    bwd = _rows(ops, phase="backward", op="mm")
    assert set(bwd["dtype"]) == {"bfloat16"} and set(bwd["module"]) == {"0", "2"}
    assert set(bwd["grad_fn"]) == {"AddmmBackward0"} and set(bwd["reason"]) == {"backward"}
    by = summary.by_dtype.set_index("dtype")
    assert by.loc["bfloat16", "flops"] == _gemm_flops()
    assert by.loc["bfloat16", "flops_share"] == 1.0
    assert 0 < by.loc["float32", "bytes_share"] < 1
    fp32 = summary.fp32_ops
    assert {"pow", "mean"} <= set(_rows(fp32, phase="loss")["op"])
    assert summary.config == "O1" and summary.half_dtype == "bfloat16"


def test_o2_model_cast_and_loss_scaling(x):
    ops, summary = trace_precision(_mlp(), x, "O2", half_dtype=torch.bfloat16)
    fwd = _rows(ops, phase="forward", op="addmm")
    assert set(fwd["dtype"]) == {"bfloat16"} and set(fwd["reason"]) == {"promotion"}
    assert fwd["detail"].str.contains("O2 cast the model").all()
    first = ops.iloc[0]  # amp's forward pre-hook casts the input
    assert (first["module"], first["kind"], first["reason"]) == ("(root)", "cast", "explicit-cast")
    scaling = _rows(ops, phase="loss-scaling")
    assert len(scaling) and set(scaling["dtype"]) <= {"float32", "-"}
    assert summary.by_dtype.set_index("dtype").loc["bfloat16", "flops"] == _gemm_flops()


def test_fp8_recipe_runs_gemms_in_float8(x, monkeypatch):
    from mpnb.core.fp8 import gemm
    from mpnb.core.hardware import DtypeSupport

    # where torch._scaled_mm measured faster than fp32 (else the emulated GEMM runs: below)
    fast = DtypeSupport("float8_e4m3fn", "native", 2.0, "probe")
    monkeypatch.setattr(gemm, "dtype_support", lambda d: {"float8_e4m3fn": fast})
    ops, summary = trace_precision(_mlp(), x, "fp8-tensorwise")
    mm = _rows(ops, op="_scaled_mm")
    assert set(mm["reason"]) == {"fp8-recipe"}
    assert list(_rows(mm, phase="forward")["dtype"]) == ["float8_e4m3fn"] * 2
    assert set(_rows(mm, phase="backward")["dtype"]) == {"float8_e4m3fn+float8_e5m2"}
    assert len(_rows(mm, phase="backward")) == 3  # dW twice, dx once
    quant = _rows(ops, kind="cast", dtype="float8_e4m3fn")
    assert quant["detail"].str.startswith("quantize").all()
    relu = _rows(ops, phase="forward", op="relu")
    assert relu["dtype"].item() == "float32" and relu["reason"].item() == "promotion"
    by = summary.by_dtype.set_index("dtype")
    fp8_flops = by.loc[[d for d in by.index if d.startswith("float8")], "flops"].sum()
    assert fp8_flops == _gemm_flops()
    assert summary.fp8_emulated  # CPU: FP8 numerics, not FP8 speed
    assert "FP8 is emulated" in str(summary)


def test_mxfp8_gemms_are_emulated_float32_matmuls(x):
    with pytest.warns(UserWarning, match="MXFP8 GEMMs run emulated"):
        ops, summary = trace_precision(_mlp(), x, "mxfp8")
    gemm = _rows(ops, reason="fp8-recipe", op="mm")
    assert len(gemm) == 5 and set(gemm["dtype"]) == {"float32"}
    assert gemm["detail"].str.contains("emulated FP8 GEMM").all()
    assert summary.by_dtype.set_index("dtype").loc["float32", "flops"] == _gemm_flops()


@pytest.mark.parametrize("config, fmt", [("nvfp4", "NVFP4"), ("mxfp4", "MXFP4")])
def test_four_bit_layers_are_named_in_their_format_and_not_listed_as_float32(x, config, fmt):
    ops, summary = trace_precision(_mlp(), x, config)
    recipe = _rows(ops, reason="fp8-recipe")
    gemm = recipe[recipe["op"].isin(["mm", "bmm", "addmm", "matmul"])]
    assert len(gemm) and gemm["detail"].str.contains(f"emulated {fmt} GEMM").all()
    assert not recipe["detail"].str.contains("FP8").any()
    # the recipe's scaling math is the recipe, not an op that "stayed" float32; its emulated
    # GEMM is listed: it computes in float32
    listed = summary.fp32_ops[summary.fp32_ops["reason"] == "fp8-recipe"]
    assert set(listed["op"]) == {"bmm"}
    assert (ops[(ops.reason == "fp8-recipe") & (ops.op == "abs")]["dtype"] == "float32").any()
    assert summary.fp8_emulated and summary.scaled_format == fmt
    assert f"{fmt} is emulated on this device" in str(summary)


@amp.half_function
def _scores(a, b):
    return a @ b


class _Block(torch.nn.Module):
    """Exercises autocast's fp32 and promote lists, a disabled region and an amp wrapper."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(K, H)
        self.w = torch.nn.Parameter(torch.randn(H, H))

    def forward(self, x):
        h = self.fc(x)
        pen = F.mse_loss(h, torch.zeros_like(h))
        with amp.disable_casts():
            g = h.float() @ self.w
        s = _scores(g, self.w)
        pos = torch.arange(H, device=x.device).float() * h.argmax(-1).float().mean()
        return torch.cat([g, h], 0).sum(0) + s.sum(0) + pen + pos


def test_o1_reasons_fp32_list_promote_disabled_region_and_registration(x):
    ops, summary = trace_precision(_Block(), x, "O1", half_dtype=torch.bfloat16)
    fwd = ops[ops["phase"] == "forward"]
    mse = _rows(fwd, op="mse_loss")
    assert mse["dtype"].item() == "float32" and mse["reason"].item() == "autocast-fp32"
    assert set(_rows(fwd, api="torch.nn.functional.mse_loss", kind="cast")["reason"]) == {
        "autocast-cast"
    }
    mm = _rows(fwd, op="mm")
    disabled = mm[mm["reason"] == "autocast-disabled"]
    assert len(disabled) == 1 and disabled["dtype"].item() == "float32"
    wrapped = mm[mm["reason"] == "user-registration"]
    assert wrapped["dtype"].item() == "bfloat16" and "half" in wrapped["detail"].item()
    cat = _rows(fwd, op="cat")
    assert cat["reason"].item() == "autocast-promote" and cat["dtype"].item() == "float32"
    fp32 = summary.fp32_ops.set_index("op")
    assert fp32.loc["mse_loss", "reason"] == "autocast-fp32"
    assert _rows(fwd, op="arange")["reason"].item() == "promotion"  # no floating inputs
    assert set(_rows(fwd, op="_to_copy", api="Tensor.float")["reason"]) == {"explicit-cast"}
    assert _rows(fwd, op="argmax")["reason"].item() == "promotion"  # measured: no autocast cast
    assert "unknown" not in set(ops["reason"])


def test_the_users_model_and_amp_state_are_untouched(x):
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    user_model, _ = amp.initialize(
        _mlp(), torch.optim.SGD(_mlp().parameters(), lr=0.1), opt_level="O1", verbosity=0
    )
    amp_latest = amp.current_handle()
    trace_precision(model, x, "O2")
    trace_precision(model, x, "fp8-delayed")
    assert type(model[0]) is torch.nn.Linear and model[0].weight.dtype == torch.float32
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert model[0].weight.grad is None
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks
    assert amp.current_handle() is amp_latest


def test_bad_configs_are_refused_clearly(x):
    with pytest.raises(ValueError, match="valid choices"):
        trace_precision(_mlp(), x, "O4")


@pytest.mark.parametrize("config", ["bf16-pure+sr", "bf16-pure+kahan"])
def test_configs_that_need_their_own_optimizer_are_traced(x, config):
    """The trace builds the optimizer itself, so it builds the one the configuration needs
    (it used to ask the user for a FusedAdam(stochastic_rounding=True) it never took)."""
    ops, summary = trace_precision(_mlp(), x, config)
    fwd = _rows(ops, phase="forward", op="addmm")
    assert set(fwd["dtype"]) == {"bfloat16"} and len(fwd) == 2
    assert summary.config == config


class _DictOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(K, N)

    def forward(self, x):
        return {"hidden": x, "logits": self.fc(x)}


def test_a_dict_output_is_traced_with_the_default_loss(x):
    """The default loss finds the logits as compare does (it called .float() on the dict)."""
    ops, _ = trace_precision(_DictOut(), x, "O1", half_dtype=torch.bfloat16)
    loss = _rows(ops, phase="loss")
    assert {"pow", "mean"} <= set(loss["op"])
    assert _rows(ops, phase="backward", op="mm")["dtype"].tolist() == ["bfloat16"]


def test_a_model_without_parameters_gets_a_clear_error(x):
    with pytest.raises(ValueError, match="ReLU has no parameters") as e:
        trace_precision(torch.nn.ReLU(), x, "O1")
    assert "module that owns" in str(e.value)  # the fix


class _Ops:
    @staticmethod
    def gate(a, b):
        return torch.sigmoid(a) * b


class _Gated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(K, H)

    def forward(self, x):
        h = self.fc(x)
        return _Ops.gate(h, h)


def test_a_registered_function_is_named_in_the_trace(x):
    from mpnb.core.amp.casts import default_registry

    amp.register_float_function(_Ops, "gate")
    try:
        ops, _ = trace_precision(_Gated(), x, "O1", half_dtype=torch.bfloat16)
    finally:
        default_registry.entries.pop((id(_Ops), "gate"))
    gate = _rows(ops, phase="forward", op="sigmoid")
    assert gate["reason"].item() == "user-registration" and gate["dtype"].item() == "float32"
    assert "float function _Ops.gate" in gate["detail"].item()
    assert _rows(ops, phase="forward", op="addmm")["dtype"].item() == "bfloat16"


def test_a_call_whose_argument_changed_in_place_has_an_unknown_rule():
    from mpnb.lab._precision_trace import Call, autocast_policy

    a, b = torch.randn(4, 4), torch.randn(4, 4)
    call = Call(0, "torch.mm", torch.mm, True, (a, b), {}, (a._version, b._version))
    assert autocast_policy(call, "cpu", torch.bfloat16) == "lower-precision"
    a.add_(1)
    assert autocast_policy(call, "cpu", torch.bfloat16) == "unknown"
    soft = Call(1, "torch.softmax", torch.softmax, True, (b, -1), {}, (b._version,))
    assert autocast_policy(soft, "cpu", torch.bfloat16) == "none"


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x)[0]


def test_each_op_is_explained_by_its_own_rule_not_by_the_call_around_it():
    """multi_head_attention_forward is on no autocast list: its mm, bmm and addmm are (their
    own rule), the bias add ran in the dtype autocast cast the bias to, and the ops that only
    follow their inputs (clone of a result, the softmax on CPU, the mean) are promotion."""
    ops, _ = trace_precision(_Attention(), torch.randn(2, 5, 16), "O1", half_dtype=torch.bfloat16)
    fwd = _rows(ops, phase="forward")
    work = fwd[fwd["kind"] != "view"]
    assert not work["detail"].str.contains("multi_head_attention_forward is on").any()
    for op in ("mm", "bmm", "addmm"):
        rows = _rows(work, op=op)
        assert len(rows) and set(rows["reason"]) == {"autocast-lower-precision"}
        assert rows["detail"].str.startswith(f"{op} is on autocast's bfloat16 list").all()
    add = _rows(work, op="add")
    assert add["reason"].item() == "autocast-lower-precision"
    assert "cast to bfloat16 by torch.autocast" in add["detail"].item()
    assert "add itself has no autocast rule" in add["detail"].item()
    for op in ("_softmax", "mean", "mul"):
        assert set(_rows(work, op=op)["reason"]) == {"promotion"}, op
    casts = _rows(work, kind="cast", reason="autocast-cast")
    assert len(casts) >= 4
    assert casts["detail"].str.contains("for (?:mm|addmm), on autocast's lower-precision").any()


def test_the_loss_scaling_ops_are_labelled_loss_scaling(x):
    """amp's loss * scale, its backward and the unscale are loss-scaling, in both phase and
    reason (the backward of the scaling multiplication read as the model's backward)."""
    ops, _ = trace_precision(_mlp(), x, "O2", half_dtype=torch.float16)
    scaling = _rows(ops, phase="loss-scaling")
    assert set(scaling["reason"]) == {"loss-scaling"}
    back = scaling[scaling["grad_fn"] != ""]
    assert len(back) and set(back["grad_fn"]) == {"MulBackward0"}
    assert back["detail"].str.contains("backward of the loss scaling").all()
    assert "multi_tensor_scale" in "".join(scaling["op"])  # the unscale
    model_bwd = _rows(ops, phase="backward")
    assert "MulBackward0" not in set(model_bwd["grad_fn"])  # the MLP has no multiplication
    assert set(model_bwd["reason"]) == {"backward"}
