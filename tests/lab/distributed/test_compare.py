"""The distributed comparison (``mpnb.lab.distributed._compare``): every policy on 2 ranks (loss,
shards, bytes, memory), a failing or hung rank named, the user's own model, the refusals."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import mpnb.lab
from mpnb.core.parallel.launch import cpus_available
from mpnb.core.precision_configs import DISTRIBUTED_CONFIGS, DistributedConfig
from mpnb.lab import workloads
from mpnb.lab.distributed import DIST_COLUMNS

pytestmark = pytest.mark.dist

RANKS = 2
STEPS = 5


@pytest.fixture(scope="module")
def df():
    return mpnb.lab.compare("mlp", size="small", ranks=RANKS, steps=STEPS, progress=False)


@pytest.fixture(scope="module")
def n_params():
    return sum(p.numel() for p in workloads.get("mlp", "small").model_fn().parameters())


def _row(df, policy):
    return df.set_index("policy").loc[policy]


def _ring(op, payload):
    share = payload * (RANKS - 1) / RANKS
    return int(round(2 * share if op == "all_reduce" else share))


def test_every_policy_has_a_row_with_the_contract_columns(df):
    assert set(DIST_COLUMNS) <= set(df.columns)
    assert set(df["policy"]) == set(DISTRIBUTED_CONFIGS)
    assert (df["ranks"] == RANKS).all()
    assert df.attrs["distributed"]["ranks"] == RANKS
    assert len(df.attrs["distributed"]["reference"]) == STEPS


@pytest.mark.parametrize("policy", list(DISTRIBUTED_CONFIGS))
def test_loss_curve_within_tolerance_of_single_process_fp32(df, policy):
    r = _row(df, policy)
    if r["status"] == "skipped":  # fp16 only where the device has it natively
        assert "not offered" in r["error"]
        return
    assert r["status"] == "ok", r["error"]
    assert r["steps_done"] == STEPS
    assert math.isfinite(r["loss_vs_fp32"])
    assert r["within_tolerance"], (policy, r["loss_vs_fp32"], r["tolerance"])
    if (
        DISTRIBUTED_CONFIGS[policy].param_dtype
        == DISTRIBUTED_CONFIGS[policy].reduce_dtype
        == "float32"
    ):
        assert r["loss_vs_fp32"] < 1e-4  # fp32 policies: summation order only


def test_each_rank_trains_on_its_own_shard(df):
    h = df.attrs["history"]
    first = h[(h["configuration"] == "ddp-fp32") & (h["step"] == 0)].set_index("rank")["loss"]
    assert first[0] != first[1]  # different samples on each rank
    ref = df.attrs["distributed"]["reference"][0]
    assert abs((first[0] + first[1]) / 2 - ref) < 1e-5  # the shards make the global batch


def test_ddp_bytes_are_the_analytic_all_reduce_bytes(df, n_params):
    fp32 = _ring("all_reduce", 4 * n_params)  # = 4 bytes x params on 2 ranks
    assert fp32 == 4 * n_params
    assert _row(df, "ddp-fp32")["bytes_by_op"]["all_reduce"] == fp32
    for half in ("ddp-bf16-compress", "ddp-fp16-compress", "ddp-mpnb-O2"):
        r = _row(df, half)
        if r["status"] == "ok":
            assert r["bytes_by_op"]["all_reduce"] == fp32 // 2, half


def test_fsdp2_bytes_are_the_analytic_all_gather_and_reduce_scatter_bytes(df, n_params):
    # every parameter is all-gathered for the forward and again for the backward (the
    # non-root units reshard after forward), and its gradient reduce-scattered once
    for policy, pbytes, rbytes in (
        ("fsdp2-fp32", 4, 4),
        ("fsdp2-bf16-param-fp32-reduce", 2, 4),
        ("fsdp2-bf16-reduce", 2, 2),
    ):
        ops = _row(df, policy)["bytes_by_op"]
        assert ops["all_gather"] == 2 * _ring("all_gather", pbytes * n_params), policy
        assert ops["reduce_scatter"] == _ring("reduce_scatter", rbytes * n_params), policy
        assert _row(df, policy)["bytes_sent_per_step"] == sum(ops.values())


def test_fsdp2_keeps_about_one_nth_of_params_and_optimizer_state(df):
    ddp, fsdp = _row(df, "ddp-fp32"), _row(df, "fsdp2-fp32")
    for col in ("mem_sharded_params_mib", "mem_optimizer_mib", "mem_grads_mib"):
        ratio = fsdp[col] / ddp[col]
        assert 1 / RANKS * 0.95 <= ratio <= 1 / RANKS * 1.1, (col, ratio)
    # the all-gathered (unsharded) parameters: the whole model while a unit computes
    assert ddp["mem_unsharded_params_mib"] == 0
    assert fsdp["mem_unsharded_params_mib"] > fsdp["mem_sharded_params_mib"]
    bf16 = _row(df, "fsdp2-bf16-param-fp32-reduce")
    assert bf16["mem_unsharded_params_mib"] == pytest.approx(
        fsdp["mem_unsharded_params_mib"] / 2, rel=0.05
    )
    for _, r in df[df["status"] == "ok"].iterrows():
        assert r["mem_activations_mib"] > 0
        parts = ("sharded_params", "grads", "optimizer")
        assert r["mem_peak_mib"] >= max(r[f"mem_{p}_mib"] for p in parts)


def test_step_time_and_comm_time_are_measured(df):
    ok = df[df["status"] == "ok"]
    assert (ok["step_ms"] > 0).all() and (ok["comm_s"] > 0).all()
    assert (ok["timed_steps"] == STEPS - 2).all()
    assert (ok["flops_per_step"] > 0).all()


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(ranks=0), "ranks=0"),
        (dict(ranks=-1), "ranks=-1"),
        (dict(ranks=2, timeout=0), "timeout=0"),
        (dict(ranks=2, timeout=float("nan")), "timeout=nan"),
        (dict(ranks=cpus_available() + 1), "CPU"),
    ],
)
def test_compare_refuses_bad_rank_counts_and_timeouts(kw, says):
    with pytest.raises(ValueError, match=says):
        mpnb.lab.compare("mlp", size="small", steps=4, progress=False, **kw)


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
    assert "rank 1" in bad["error"] and "policy 'ddp-hangs'" in bad["error"]
    _kept(df.loc["ddp-fp32"])


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
