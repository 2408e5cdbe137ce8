"""A rank that fails or hangs in one policy ends the distributed comparison in bounded time,
naming the rank and the policy; the steps already measured are kept in the rows."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch.distributed as dist

import mpnb.lab
from mpnb.core.precision_configs import DISTRIBUTED_CONFIGS, DistributedConfig

pytestmark = pytest.mark.dist

FAIL_AT = 2  # the step (0-based) at which rank 1 fails
_BACKWARDS: dict[str, int] = {}


@dataclass(frozen=True)
class FaultyConfig(DistributedConfig):
    """ddp-fp32 whose backward on rank 1 raises or never returns from step FAIL_AT on."""

    fault: str = "raise"

    def backward(self, loss, optimizer) -> None:
        _BACKWARDS[self.name] = _BACKWARDS.get(self.name, 0) + 1  # in this rank's process
        if dist.get_rank() == 1 and _BACKWARDS[self.name] > FAIL_AT:
            if self.fault == "raise":
                raise RuntimeError("injected failure")
            time.sleep(3600)
        super().backward(loss, optimizer)


def _faulty(fault: str) -> FaultyConfig:
    base = DISTRIBUTED_CONFIGS["ddp-fp32"]
    return FaultyConfig(
        f"ddp-{fault}s",
        "test policy",
        base.strategy,
        base.param_dtype,
        base.reduce_dtype,
        fault=fault,
    )


def _compare(fault: str, timeout: float):
    t0 = time.monotonic()
    df = mpnb.lab.compare(
        "mlp",
        size="small",
        ranks=2,
        steps=6,
        configs=["ddp-fp32", _faulty(fault)],
        timeout=timeout,
        progress=False,
    )
    return df.set_index("policy"), time.monotonic() - t0


def _kept(good) -> None:
    assert good["status"] == "interrupted"
    assert good["steps_done"] >= FAIL_AT  # the steps before the failure are kept
    assert good["bytes_by_op"]["all_reduce"] > 0
    assert good["loss_vs_fp32"] < 1e-4
    assert "ddp-raises" in good["error"] or "ddp-hangs" in good["error"]


def test_a_failing_rank_is_named_with_its_policy_and_the_measured_rows_are_kept():
    df, _ = _compare("raise", timeout=120)
    bad = df.loc["ddp-raises"]
    assert bad["status"] == "error"
    assert "rank 1" in bad["error"] and "'ddp-raises'" in bad["error"]
    assert "injected failure" in bad["error"]
    assert bad["steps_done"] == FAIL_AT
    _kept(df.loc["ddp-fp32"])


def test_a_hung_rank_ends_the_comparison_within_the_timeout():
    timeout = 15
    df, took = _compare("hang", timeout=timeout)
    assert took < timeout + 30  # the timeout, the reference run and stopping the ranks
    bad = df.loc["ddp-hangs"]
    assert bad["status"] == "hung"
    assert "rank 1 in policy 'ddp-hangs'" in bad["error"]
    _kept(df.loc["ddp-fp32"])
