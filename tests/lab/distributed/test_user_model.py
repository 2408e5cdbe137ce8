"""compare(model_fn, data, ranks=2): the user's own model factory and data, as in one process."""

from __future__ import annotations

import pytest
import torch

import mpnb.lab

pytestmark = pytest.mark.dist


def test_a_lambda_factory_and_tensors_train_on_two_ranks():
    torch.manual_seed(0)
    x, y = torch.randn(64, 12), torch.randint(0, 3, (64,))
    df = mpnb.lab.compare(
        lambda: torch.nn.Sequential(
            torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
        ),
        (x, y),
        metric_fn=mpnb.lab.accuracy,
        ranks=2,
        strategy="fsdp2",
        configs=["fsdp2-fp32"],
        batch_sizes=(16,),
        steps=3,
        progress=False,
    )
    r = df.iloc[0]
    assert r["status"] == "ok", r["error"]
    assert r["loss_vs_fp32"] < 1e-4 and 0 <= r["metric"] <= 1
    # FSDP2 pads each parameter's dim 0 to a multiple of the ranks: (3, 16) and (3,) travel
    # as (4, 16) and (4,)
    padded = 12 * 16 + 16 + 4 * 16 + 4
    assert r["bytes_by_op"]["reduce_scatter"] == 4 * padded // 2


def test_a_global_batch_the_ranks_cannot_split_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"batch_sizes=\(14,\)"):
        mpnb.lab.compare("mlp", size="small", ranks=2, batch_sizes=(15,), steps=2)


def test_strategy_without_ranks_and_a_policy_of_the_other_strategy_are_refused():
    with pytest.raises(ValueError, match="needs ranks >= 2"):
        mpnb.lab.compare("mlp", strategy="fsdp2", steps=2)
    with pytest.raises(ValueError, match="not 'ddp' policies"):
        mpnb.lab.compare("mlp", ranks=2, strategy="ddp", configs=["fsdp2-fp32"], steps=2)
