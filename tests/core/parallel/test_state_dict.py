"""full_state_dict / load_full_state_dict on 2 gloo ranks: an FSDP2 model's DTensor shards
gathered into the tensors a plain model loads, DDP's prefix gone, a full state dict loaded
back into a sharded model, and DTensor shards refused by name."""

from __future__ import annotations

import pytest
import torch

from mpnb import parallel
from mpnb.core.precision_configs import DISTRIBUTED_CONFIGS
from mpnb.parallel import launch
from tests.core.parallel.test_distributed_config import _error, _mlp, _sgd

pytestmark = pytest.mark.dist


def _same(sd: dict, ref: dict) -> bool:
    return list(sd) == list(ref) and all(
        type(sd[k]) is torch.Tensor and torch.equal(sd[k], ref[k]) for k in ref
    )


def _ranks() -> dict:
    ref = _mlp().state_dict()
    out = {}
    fsdp, _ = DISTRIBUTED_CONFIGS["fsdp2-fp32"].wrap(_mlp(), _sgd)
    plain = _mlp(seed=1)
    out["shards refused"] = _error(lambda: parallel.load_full_state_dict(plain, fsdp.state_dict()))
    full = parallel.full_state_dict(fsdp)
    out["fsdp2 full"] = _same(full, ref)
    parallel.load_full_state_dict(plain, full)
    out["plain loaded"] = _same(plain.state_dict(), ref)
    for name in ("ddp-fp32", "ddp-mpnb-O2"):
        model, _ = DISTRIBUTED_CONFIGS[name].wrap(_mlp(), _sgd)
        out[f"{name} keys"] = list(parallel.full_state_dict(model)) == list(ref)
    other, _ = DISTRIBUTED_CONFIGS["fsdp2-fp32"].wrap(_mlp(seed=2), _sgd)
    parallel.load_full_state_dict(other, ref)  # each rank keeps its shard of the full tensors
    out["fsdp2 loaded"] = _same(parallel.full_state_dict(other), ref)
    offloaded = parallel.full_state_dict(fsdp, cpu_offload=True)
    out["offloaded"] = sorted({str(v.device) for v in offloaded.values()})
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return launch(_ranks, 2, backend="gloo", timeout=120, threads=1)


def test_dtensor_shards_are_refused_naming_the_helper(ranks):
    for r in ranks:
        assert r["shards refused"].startswith("TypeError"), r["shards refused"]
        assert "full_state_dict" in r["shards refused"]


def test_the_full_state_dict_of_a_sharded_model_loads_into_a_plain_one(ranks):
    for r in ranks:
        assert r["fsdp2 full"] and r["plain loaded"]


@pytest.mark.parametrize("name", ["ddp-fp32", "ddp-mpnb-O2"])
def test_a_ddp_full_state_dict_has_the_plain_model_keys(ranks, name):
    assert all(r[f"{name} keys"] for r in ranks)


def test_a_full_state_dict_loads_into_a_sharded_model(ranks):
    assert all(r["fsdp2 loaded"] for r in ranks)


def test_cpu_offload_gives_rank_0_alone_the_tensors_on_the_cpu(ranks):
    assert ranks[0]["offloaded"] == ["cpu"]
    assert ranks[1]["offloaded"] == []
