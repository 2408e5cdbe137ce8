"""mpnb amp O1-O3 on an FSDP2-sharded model are refused up front, naming the FSDP2 policy.

amp raises a typed :class:`ShardedModelError` with the ``MixedPrecisionPolicy`` dtypes; the
precision configurations (the layer above) reword it with their policy's name.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mpnb.core import amp
from mpnb.core.precision_configs import DISTRIBUTED_CONFIGS, fsdp2_instead_of

pytestmark = pytest.mark.dist


@pytest.fixture
def one_rank_group():
    """A gloo group of one rank in this process (enough for fully_shard)."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sharded():
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


@pytest.mark.parametrize(
    "level, policy",
    [
        ("O1", "fsdp2-bf16-param-fp32-reduce"),
        ("O2", "fsdp2-bf16-param-fp32-reduce"),
        ("O3", "fsdp2-bf16-reduce"),
    ],
)
def test_amp_on_an_fsdp2_model_is_refused_naming_the_policy(one_rank_group, level, policy):
    model, opt = _sharded()
    before = [p.to_local().clone() for p in model.parameters()]
    with pytest.raises(amp.ShardedModelError, match="MixedPrecisionPolicy") as e:
        amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    assert isinstance(e.value, ValueError) and e.value.opt_level == level
    named = fsdp2_instead_of(level)
    assert named is DISTRIBUTED_CONFIGS[policy]
    assert named.dtypes() == {"param": e.value.param_dtype, "reduce": e.value.reduce_dtype}
    assert f"'{policy}'" in e.value.message(named.name)
    # up front: nothing was cast
    for p, b in zip(model.parameters(), before, strict=True):
        assert p.dtype == torch.float32 and torch.equal(p.to_local(), b)


def test_fsdp2_instead_of_o0_is_refused_with_the_levels_that_have_one():
    with pytest.raises(ValueError, match="only O1-O3"):
        fsdp2_instead_of("O0")


def test_o0_on_an_fsdp2_model_is_accepted(one_rank_group):
    model, opt = _sharded()
    model, opt = amp.initialize(model, opt, opt_level="O0", verbosity=0)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()  # the sharded model trains, in fp32, through amp's O0
    assert all(p.dtype == torch.float32 and p.grad is not None for p in model.parameters())
