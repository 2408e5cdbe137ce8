"""DistributedConfig says what it does and refuses what it cannot do: checked at construction,
the row's precision text read from the plan that wrap() follows, a second wrap() refused, and
an fp16 reduction that overflows stopped before the step, naming the overflow."""

from __future__ import annotations

import pytest
import torch

from mpnb import parallel
from mpnb.core.precision_configs import DISTRIBUTED_CONFIGS, DistributedConfig
from mpnb.parallel import launch


def _cfg(strategy="ddp", param="float32", reduce="float32", **kw) -> DistributedConfig:
    return DistributedConfig("test", "a test policy", strategy, param, reduce, **kw)


# ---- construction ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        (dict(strategy="zero3"), "strategy='zero3'"),
        (dict(param="float8"), "param_dtype='float8'"),
        (dict(strategy="fsdp2", reduce="int8"), "reduce_dtype='int8'"),
        (dict(param="bfloat16"), "amp_level='O2'"),  # DDP of an fp32 model: fp32 params
        (dict(reduce="bfloat16"), "compress='bfloat16'"),  # no hook: grads travel as params
        (dict(reduce="float32", compress="bfloat16"), "reduce_dtype='bfloat16'"),
        (dict(compress="float8"), "compress='float8'"),
        (dict(strategy="fsdp2", reduce="bfloat16", compress="bfloat16"), "MixedPrecisionPolicy"),
        (dict(strategy="fsdp2", param="bfloat16", amp_level="O2"), "MixedPrecisionPolicy"),
        (dict(param="bfloat16", reduce="bfloat16", amp_level="O1"), "amp_level='O1'"),
        (dict(param="float32", reduce="float32", amp_level="O2"), "half"),
        (dict(param="bfloat16", reduce="float32", amp_level="O2"), "reduce_dtype"),
        (dict(tolerance=-1.0), "tolerance"),
    ],
)
def test_a_policy_it_cannot_run_is_refused_at_construction(kw, key):
    with pytest.raises(ValueError, match=key.replace("(", r"\(")):
        _cfg(**kw)


def test_short_dtype_names_are_accepted_as_torch_names():
    c = _cfg("fsdp2", "bf16", "fp32")
    assert (c.param_dtype, c.reduce_dtype) == ("bfloat16", "float32")
    assert c.dtypes() == {"param": torch.bfloat16, "reduce": torch.float32}


@pytest.mark.parametrize("name", list(DISTRIBUTED_CONFIGS))
def test_the_precision_text_says_the_collective_and_how_grads_are_made_half(name):
    c = DISTRIBUTED_CONFIGS[name]
    text = c.precision_text()
    assert ("reduce-scatter" if c.sharded() else "all-reduce") in text, text
    if c.compress:
        assert f"{c.plan().hook}" in text and c.plan().hook, text
    if c.amp_level:
        assert f"amp {c.amp_level}" in text, text


def test_a_compression_hook_is_in_the_text_and_the_plan():
    c = _cfg(reduce="bfloat16", compress="bfloat16")
    assert c.plan().hook == "bf16_compress_hook"
    assert c.precision_text() == "fp32 params, bf16 all-reduce (bf16_compress_hook)"


# ---- on 2 gloo ranks: a second wrap, an fp16 reduction that overflows -----------------------


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _overflow(cfg: DistributedConfig, scale: float) -> dict:
    model, opt = cfg.wrap(_mlp(), _sgd)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.full((2, 4), 1e4)
    loss = model(x).pow(2).sum() * scale
    err = _error(lambda: cfg.backward(loss, opt))
    opt.step()  # a caller that steps anyway changes nothing: the grads were dropped
    after = list(model.parameters())
    same = all(torch.equal(a.detach(), b) for a, b in zip(after, before, strict=True))
    return dict(error=err, unchanged=same, finite=all(bool(p.isfinite().all()) for p in after))


def _ranks() -> dict:
    out = {}
    for name in ("fsdp2-fp32", "ddp-fp32"):
        cfg = DISTRIBUTED_CONFIGS[name]
        model, _ = cfg.wrap(_mlp(), _sgd)
        out[f"rewrap {name}"] = _error(lambda cfg=cfg, model=model: cfg.wrap(model, _sgd))
        out[f"mpnb ddp of {name}"] = _error(lambda m=model: parallel.DistributedDataParallel(m))
    out["fp16 compress"] = _overflow(DISTRIBUTED_CONFIGS["ddp-fp16-compress"], 1e6)
    out["fp16 compress, small grads"] = _overflow(DISTRIBUTED_CONFIGS["ddp-fp16-compress"], 1e-3)
    out["fsdp2 fp16 reduce"] = _overflow(_cfg("fsdp2", "float32", "float16"), 1e6)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return launch(_ranks, 2, backend="gloo", timeout=120, threads=1)


@pytest.mark.dist
@pytest.mark.parametrize("name", ["fsdp2-fp32", "ddp-fp32"])
def test_wrap_refuses_a_model_it_already_wrapped(ranks, name):
    for r in ranks:
        assert r[f"rewrap {name}"].startswith("ValueError"), r[f"rewrap {name}"]
        assert "already" in r[f"rewrap {name}"] and "fresh model" in r[f"rewrap {name}"]


@pytest.mark.dist
@pytest.mark.parametrize("name", ["fsdp2-fp32", "ddp-fp32"])
def test_mpnb_ddp_refuses_a_model_already_wrapped(ranks, name):
    for r in ranks:
        got = r[f"mpnb ddp of {name}"]
        assert got.startswith("ValueError") and "already wrapped" in got, got


@pytest.mark.dist
@pytest.mark.parametrize("case", ["fp16 compress", "fsdp2 fp16 reduce"])
def test_an_fp16_reduction_that_overflows_is_refused_before_the_step(ranks, case):
    for r in ranks:  # every rank decides alike (FSDP2's shards differ: the flag is reduced)
        got = r[case]
        assert got["error"].startswith(parallel.GradOverflowError.__name__), got["error"]
        assert "65504" in got["error"] and "bf16" in got["error"]
        assert got["unchanged"] and got["finite"]


@pytest.mark.dist
def test_an_fp16_reduction_within_range_steps_as_before(ranks):
    for r in ranks:
        got = r["fp16 compress, small grads"]
        assert got["error"] == "" and not got["unchanged"] and got["finite"]
