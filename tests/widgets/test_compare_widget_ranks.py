"""Headless tests of CompareWidget's ranks and strategy: the controls, the call they make, and
the distributed views drawn from the rows (a recorded stand-in for ``compare`` here; the real
2-rank run is in test_real_two_rank_run)."""

from __future__ import annotations

import pandas as pd
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

import mpnb.lab  # noqa: E402
from mpnb.lab.distributed import DIST_COLUMNS  # noqa: E402
from mpnb.widgets import CompareWidget  # noqa: E402

MIB = 2**20


def _row(policy, strategy, reduce, sharded, unsharded, by_op, loss_diff, tol=1e-2):
    sent = sum(by_op.values())
    return dict(
        ranks=2,
        strategy=strategy,
        policy=policy,
        param_dtype="bfloat16" if "bf16-param" in policy else "float32",
        reduce_dtype=reduce,
        mem_sharded_params_mib=sharded,
        mem_unsharded_params_mib=unsharded,
        mem_grads_mib=sharded,
        mem_optimizer_mib=2 * sharded,
        mem_activations_mib=0.5,
        mem_peak_mib=sharded * 4 + unsharded + 0.5,
        bytes_sent_per_step=sent,
        bytes_recv_per_step=sent,
        bytes_by_op=by_op,
        comm_s=1e-3,
        step_ms=12.0,
        step_ms_lo=11.5,
        step_ms_hi=12.5,
        loss_final=0.7,
        loss_vs_fp32=loss_diff,
        tolerance=tol,
        within_tolerance=loss_diff <= tol,
        flops_per_step=2.0e9,
        status="ok",
        error="",
    )


def _fake_frame(strategy):
    rows = [
        _row("ddp-fp32", "ddp", "float32", 4.0, 0.0, {"all_reduce": 4 * MIB}, 1e-6),
        _row("ddp-bf16-compress", "ddp", "bfloat16", 4.0, 0.0, {"all_reduce": 2 * MIB}, 3e-3),
        _row(
            "fsdp2-fp32",
            "fsdp2",
            "float32",
            2.0,
            4.0,
            {"all_gather": 2 * MIB, "reduce_scatter": 2 * MIB},
            2e-6,
        ),
        _row(
            "fsdp2-bf16-reduce",
            "fsdp2",
            "bfloat16",
            2.0,
            4.0,
            {"all_gather": 2 * MIB, "reduce_scatter": MIB},
            2e-2,
        ),
    ]
    df = pd.DataFrame([r for r in rows if strategy in (None, "both", r["strategy"])])
    assert list(df.columns) == list(DIST_COLUMNS)  # the stand-in keeps to the contract
    df.attrs["distributed"] = dict(ranks=2, strategy=strategy, global_batch=32, reference=[])
    return df


@pytest.fixture
def calls(monkeypatch):
    """mpnb.lab.compare replaced by a recorder that returns the contract's frame."""
    seen = []

    def fake_compare(**kw):
        seen.append(kw)
        return _fake_frame(kw.get("strategy"))

    monkeypatch.setattr(mpnb.lab, "compare", fake_compare)
    return seen


def test_ranks_and_strategy_are_passed_to_compare(calls):
    cw = CompareWidget("mlp", ranks=2, strategy="fsdp2", threaded=False, steps=4)
    assert cw.ranks.value == 2 and cw.strategy.value == "fsdp2"
    assert not cw.strategy.disabled and cw.opt_levels.disabled  # policies, not opt levels
    cw.run_button.click()
    assert cw.errors.last_error is None, cw.errors.last_error
    kw = calls[-1]
    assert kw["ranks"] == 2 and kw["strategy"] == "fsdp2" and kw["configs"] is None
    assert kw["steps"] == 4 and kw["workload"] == "mlp"
    assert list(cw.df["policy"]) == ["fsdp2-fp32", "fsdp2-bf16-reduce"]
    cw.strategy.value = "ddp"  # the control, changed after construction, is what is sent
    cw.ranks.value = 3
    cw.run_button.click()
    assert calls[-1]["strategy"] == "ddp" and calls[-1]["ranks"] == 3


def test_one_rank_makes_todays_call(calls):
    cw = CompareWidget("mlp", threaded=False)
    assert cw.ranks.value == 1 and cw.strategy.disabled and not cw.opt_levels.disabled
    assert cw.request().keys().isdisjoint({"ranks", "strategy"})
    assert cw.tabs.titles[0] == "Speed"


def test_distributed_views_show_memory_wire_and_loss(calls):
    cw = CompareWidget("mlp", ranks=2, threaded=False)
    cw.run_button.click()
    df = cw.df
    names = list(df["policy"])
    assert cw.tabs.titles == (
        "Memory per rank",
        "Bytes on the wire",
        "Loss vs fp32",
        "Table",
        "Scale-out estimate",
        "Hardware",
    )
    v = cw.dist_views
    mem = {tr.name: list(tr.y) for tr in v.memory.data}
    assert list(v.memory.data[0].x) == names
    assert mem["sharded params"] == list(df["mem_sharded_params_mib"])
    assert mem["unsharded params"] == list(df["mem_unsharded_params_mib"])
    assert mem["optimizer"] == list(df["mem_optimizer_mib"])
    wire = {tr.name: list(tr.y) for tr in v.wire.data}
    assert set(wire) == {"all_reduce", "all_gather", "reduce_scatter"}
    assert wire["all_reduce"] == [4 * MIB, 2 * MIB, 0, 0]
    assert wire["reduce_scatter"] == [0, 0, 2 * MIB, MIB]
    bar, tol = v.loss.data
    assert list(bar.y) == list(df["loss_vs_fp32"]) and list(tol.y) == list(df["tolerance"])
    assert all(out.rendered for out in v.outputs.values())
    for name in names:
        assert name in cw.table.value
    assert "sharded params (MiB/rank)" in cw.table.value
    assert "Least memory per rank: fsdp2-fp32" in cw.verdict.value
    assert "Fewest bytes on the wire: ddp-bf16-compress" in cw.verdict.value
    assert "3 of 4" in cw.verdict.value and "fsdp2-bf16-reduce" in cw.verdict.value


def test_the_estimate_tab_is_labelled(calls):
    cw = CompareWidget("mlp", ranks=2, threaded=False)
    cw.run_button.click()
    assert "ESTIMATE, not measured" in cw.estimate.value
    assert "InfiniBand NDR 400 Gb/s" in cw.estimate.value and "ddp-fp32" in cw.estimate.value


def test_a_failed_policy_is_named_and_the_others_drawn(calls, monkeypatch):
    def failing(**kw):
        df = _fake_frame(kw.get("strategy"))
        df.loc[1, ["status", "error"]] = ["error", "rank 1 exited with code 1"]
        df.loc[3, ["status", "error"]] = ["hung", "rank 0 hung for 60 s in all_gather"]
        return df

    monkeypatch.setattr(mpnb.lab, "compare", failing)
    cw = CompareWidget("mlp", ranks=2, threaded=False)
    cw.run_button.click()
    assert "ddp-bf16-compress" in cw.config_errors.value
    assert "rank 1 exited" in cw.config_errors.value
    assert "hung for 60 s" in cw.config_errors.value
    assert list(cw.dist_views.memory.data[0].x) == ["ddp-fp32", "fsdp2-fp32"]  # the rows kept


def test_bad_ranks_are_refused_beside_the_control(calls):
    cw = CompareWidget("mlp", threaded=False)
    cw.ranks.value = 0
    assert cw.run_button.disabled and "refused, not clamped" in cw.control_errors["ranks"].value
    with pytest.raises(ValueError, match="ranks 0"):
        cw.request()
    with pytest.raises(ValueError, match="strategy 'zero3'"):
        CompareWidget("mlp", ranks=2, strategy="zero3", threaded=False)


def test_status_and_exports_of_a_distributed_run(calls, tmp_path):
    cw = CompareWidget("mlp", ranks=2, threaded=False)
    cw.run_button.click()
    assert cw.status.value == "done: 4 policies on 2 ranks"
    cw.export_path.value = str(tmp_path / "dist")
    cw.csv_button.click()
    cw.html_button.click()
    assert cw.export_errors.last_error is None, cw.export_errors.last_error
    back = pd.read_csv(tmp_path / "dist.csv")
    assert list(back["policy"]) == list(cw.df["policy"])
    page = (tmp_path / "dist.html").read_text()
    assert "ESTIMATE, not measured" in page and "Memory per rank by role" in page
    assert all(p in page for p in cw.df["policy"])


@pytest.mark.dist
@pytest.mark.slow  # two ranks spawned for three policies: about 20 s on a loaded 2-core CPU
def test_real_two_rank_run():
    """The widget over the real compare(ranks=2): FSDP2's policies on the small MLP."""
    cw = CompareWidget("mlp", ranks=2, strategy="fsdp2", steps=2, size="small", threaded=False)
    cw.run_button.click()
    assert cw.errors.last_error is None, cw.errors.last_error
    df = cw.df
    assert df.attrs["distributed"]["ranks"] == 2 and (df["strategy"] == "fsdp2").all()
    assert (df["status"] == "ok").all(), df[["policy", "error"]]
    by = df.set_index("policy")
    assert list(cw.dist_views.memory.data[0].x) == list(df["policy"])
    rs = {tr.name: list(tr.y) for tr in cw.dist_views.wire.data}["reduce_scatter"]
    assert rs == [float(d["reduce_scatter"]) for d in df["bytes_by_op"]]
    ratio = (
        by.loc["fsdp2-bf16-reduce", "bytes_by_op"]["reduce_scatter"]
        / (by.loc["fsdp2-fp32", "bytes_by_op"]["reduce_scatter"])
    )
    assert ratio == pytest.approx(0.5, abs=0.01)  # a bf16 reduction halves the bytes
    assert "ESTIMATE, not measured" in cw.estimate.value
    assert cw.status.value == f"done: {len(df)} policies on 2 ranks"


def test_policies_follow_the_strategy_and_are_passed_by_name(calls):
    from mpnb.core.precision_configs import distributed_names

    cw = CompareWidget("mlp", ranks=2, strategy="ddp", threaded=False)
    assert cw.policies.options == distributed_names("ddp") == cw.policies.value
    assert cw.request()["configs"] is None  # all chosen: compare's default (what is offered)
    cw.policies.value = ("ddp-fp32", "ddp-bf16-compress")
    cw.run_button.click()
    assert calls[-1]["configs"] == ("ddp-fp32", "ddp-bf16-compress")
    cw.strategy.value = "fsdp2"
    assert cw.policies.value == distributed_names("fsdp2")
    cw.policies.value = ()
    assert cw.run_button.disabled and "at least one policy" in cw.control_errors["policies"].value
    cw.ranks.value = 1  # one process: the policies do not count
    assert not cw.run_button.disabled and cw.policies.disabled
    named = CompareWidget("mlp", ranks=2, configs=("fsdp2-fp32",), threaded=False)
    assert named.policies.value == ("fsdp2-fp32",) and named.strategy.value == "both"
    with pytest.raises(ValueError, match="not 'ddp' policies"):
        CompareWidget("mlp", ranks=2, strategy="ddp", configs=("fsdp2-fp32",), threaded=False)
