"""scale_estimate against numbers computed by hand from the ring-collective costs.

The hand figures: InfiniBand NDR moves 50 GB/s per GPU and direction with 14 us per ring hop
and 8.4 us per call; an H100 SXM's fp32 peak is 67 TFLOP/s and its bf16 peak 989 TFLOP/s, used
at 40%.
"""

from __future__ import annotations

import pandas as pd
import pytest

from mpnb.lab.distributed.estimate import (
    INTERCONNECTS,
    LABEL,
    crossovers,
    estimate_text,
    ring_bytes,
    scale_estimate,
)

IB = "InfiniBand NDR 400 Gb/s"
NVL = "NVLink 4 (H100 SXM, in a node)"
FP32_RATE = 67e12 * 0.4  # FLOP/s the estimate gives an fp32 step on an H100 SXM
MB = 1e6


def _ddp(policy, reduce_bytes, flops, param_dtype="float32", **kw):
    # on 2 ranks a ring all-reduce sends 2 (2-1)/2 = 1x its buffer: the bytes are the buffer
    return dict(
        policy=policy,
        strategy="ddp",
        ranks=2,
        param_dtype=param_dtype,
        reduce_dtype="bfloat16" if "bf16" in policy else "float32",
        bytes_by_op={"all_reduce": reduce_bytes},
        flops_per_step=flops,
        status="ok",
        **kw,
    )


def test_ring_costs():
    assert ring_bytes("all_reduce", 1000, 4) == 1500.0  # 2 * 3/4
    assert ring_bytes("all_gather", 1000, 4) == 750.0  # 3/4
    assert ring_bytes("reduce_scatter", 1000, 8) == 875.0
    # the mean over ranks, as the lab counts a broadcast; other ops alike
    assert ring_bytes("broadcast", 1000, 8) == 875.0 and ring_bytes("all_to_all", 1000, 2) == 500
    assert ring_bytes("all_reduce", 1000, 1) == 0.0


def test_ddp_fp32_on_infiniband_by_hand():
    # 4 MB of gradients, 1 TFLOP per rank per step
    est = scale_estimate([_ddp("ddp-fp32", 4 * MB, 1e12)], gpus=(8, 64), interconnects=[IB])
    r8 = est[est["gpus"] == 8].iloc[0]
    assert r8["comm_bytes_per_gpu"] == pytest.approx(2 * 7 / 8 * 4 * MB)  # 7 MB
    # 7 MB / 50 GB/s = 140 us; latency 8.4 + 2*7 hops * 14 us = 204.4 us
    assert r8["comm_ms"] == pytest.approx(0.3444)
    assert r8["compute_ms"] == pytest.approx(1e12 / FP32_RATE * 1e3)  # 37.313 ms
    assert r8["comm_over_compute"] == pytest.approx(0.3444 / 37.3134, rel=1e-4)
    assert not r8["comm_dominates"]
    r64 = est[est["gpus"] == 64].iloc[0]
    # 2*63/64*4 MB / 50 GB/s = 157.5 us; 8.4 + 126*14 = 1772.4 us
    assert r64["comm_ms"] == pytest.approx(1.9299)
    # 160 (N-1)/N + 8.4 + 28 (N-1) us > 37313.4 us first at N = 1328 (N = 1327: 37296.3 us)
    assert (est["crossover_gpus"] == 1328).all()


def test_bf16_reduction_halves_the_bytes_and_moves_the_crossover():
    # a 100M-parameter model: 400 MB of fp32 gradients; compute set to 12 ms per step
    flops = 0.012 * FP32_RATE
    rows = [_ddp("ddp-fp32", 400 * MB, flops), _ddp("ddp-bf16-compress", 200 * MB, flops)]
    est = scale_estimate(rows, gpus=(8, 64, 512), interconnects=[IB])
    fp32 = est[est["policy"] == "ddp-fp32"].set_index("gpus")
    bf16 = est[est["policy"] == "ddp-bf16-compress"].set_index("gpus")
    ratio = bf16["comm_bytes_per_gpu"] / fp32["comm_bytes_per_gpu"]
    assert list(ratio) == pytest.approx([0.5, 0.5, 0.5])
    assert (bf16["compute_ms"] == fp32["compute_ms"]).all()  # the hook only compresses the wire
    # fp32: 16 (N-1)/N ms + latency > 12 ms first at N = 4 (N = 3: 10.73 ms; N = 4: 12.09 ms)
    assert fp32["crossover_gpus"].iloc[0] == 4
    # bf16: 8 (N-1)/N + 0.0084 + 0.028 (N-1) ms > 12 first at N = 146 (N = 145: 11.985 ms)
    assert bf16["crossover_gpus"].iloc[0] == 146
    assert fp32.loc[8, "comm_dominates"] and not bf16.loc[8, "comm_dominates"]
    table = crossovers(est)
    assert table.loc["ddp-fp32", IB] == 4 and table.loc["ddp-bf16-compress", IB] == 146


def test_fsdp2_bytes_per_rank_do_not_shrink_with_n():
    # measured on 2 ranks: each rank sent half of the 8 MB parameters (all-gather) and half of
    # the 8 MB gradients (reduce-scatter); the full buffers are 8 MB each
    row = dict(
        policy="fsdp2-fp32",
        strategy="fsdp2",
        ranks=2,
        param_dtype="float32",
        reduce_dtype="float32",
        bytes_by_op={"all_gather": 4 * MB, "reduce_scatter": 4 * MB},
        flops_per_step=1e12,
    )
    est = scale_estimate([row], gpus=(8, 64, 4096), interconnects=[IB]).set_index("gpus")
    assert est.loc[8, "comm_bytes_per_gpu"] == pytest.approx(2 * 7 / 8 * 8 * MB)  # 14 MB
    assert est.loc[4096, "comm_bytes_per_gpu"] == pytest.approx(2 * 4095 / 4096 * 8 * MB)
    assert est["comm_bytes_per_gpu"].is_monotonic_increasing
    # two calls per step, 7 hops each at N = 8: 2 * (8.4 + 7 * 14) us = 212.8 us, + 280 us
    assert est.loc[8, "comm_ms"] == pytest.approx(0.4928)


def test_bf16_params_price_compute_at_the_bf16_peak_and_calls_add_latency():
    row = _ddp("ddp-mpnb-O2", 2 * MB, 1e12, param_dtype="bfloat16", calls_by_op={"all_reduce": 3})
    est = scale_estimate([row], gpus=(8,), interconnects=[IB]).iloc[0]
    assert est["compute_ms"] == pytest.approx(1e12 / (989e12 * 0.4) * 1e3)
    # 3.5 MB / 50 GB/s = 70 us; 3 calls * (8.4 + 14 * 14) us = 613.2 us
    assert est["comm_ms"] == pytest.approx(0.6832)


def test_nvlink_stops_at_one_node_and_says_so():
    est = scale_estimate([_ddp("ddp-fp32", 4 * MB, 1e12)], gpus=(8, 64), interconnects=[NVL])
    assert list(est["gpus"]) == [8]  # NVLink 4 joins the 8 GPUs of one node
    assert est["crossover_gpus"].isna().all()  # compute stays larger up to 8 GPUs
    assert "NVLink 4 (H100 SXM, in a node) -" in estimate_text(est)
    assert INTERCONNECTS[NVL]["gbytes_s"] == 450.0 and INTERCONNECTS[IB]["gbytes_s"] == 50.0


def test_the_estimate_is_labelled_everywhere():
    est = scale_estimate(pd.DataFrame([_ddp("ddp-fp32", 4 * MB, 1e12)]))
    assert est.attrs["label"].startswith(LABEL) and "ESTIMATE" in LABEL
    assert "no overlap" in est.attrs["label"] and "weak scaling" in est.attrs["label"]
    assert est.attrs["assumptions"]["overlap"] is False
    assert estimate_text(est).splitlines()[0] == est.attrs["label"]
    assert crossovers(est).attrs["label"] == est.attrs["label"]
    assert set(est["interconnect"]) == set(INTERCONNECTS)
    assert "ESTIMATE" in scale_estimate.__doc__


def test_failed_rows_are_left_out_and_bad_input_is_refused():
    bad = dict(_ddp("ddp-fp16-compress", 0, 0.0), status="error", bytes_by_op=None)
    hung = dict(_ddp("fsdp2-fp32", 4 * MB, 1e12), status="hung")
    est = scale_estimate([_ddp("ddp-fp32", 4 * MB, 1e12), bad, hung], interconnects=[IB])
    assert set(est["policy"]) == {"ddp-fp32"}
    with pytest.raises(ValueError, match="lacks.*ranks=N"):
        scale_estimate([{"policy": "x"}])
    with pytest.raises(ValueError, match="ranks >= 2"):
        scale_estimate([dict(_ddp("ddp-fp32", 4 * MB, 1e12), ranks=1)])
    with pytest.raises(ValueError, match="not in INTERCONNECTS"):
        scale_estimate([_ddp("ddp-fp32", 4 * MB, 1e12)], interconnects=["carrier pigeon"])
    with pytest.raises(ValueError, match="fraction"):
        scale_estimate([_ddp("ddp-fp32", 4 * MB, 1e12)], utilization=1.5)


def test_a_row_without_flops_gives_no_crossover():
    row = _ddp("ddp-fp32", 4 * MB, float("nan"))
    est = scale_estimate([row], gpus=(8,), interconnects=[IB])
    assert est["crossover_gpus"].isna().all() and not est["comm_dominates"].any()
    assert est["comm_over_compute"].isna().all() and est["comm_ms"].iloc[0] == pytest.approx(0.3444)


def test_the_buffers_are_recovered_from_the_labs_own_counting():
    from mpnb.lab.distributed._comm import ring_bytes as counted

    payload = {"all_reduce": 6 * MB, "all_gather": 8 * MB, "broadcast": 2 * MB}
    measured = {op: counted(op, s, 2) for op, s in payload.items()}  # what 2 ranks record
    row = dict(_ddp("ddp-fp32", 0, 1e12), bytes_by_op=measured)
    est = scale_estimate([row], gpus=(8, 64), interconnects=[IB]).set_index("gpus")
    for n in (8, 64):
        want = sum(counted(op, s, n) for op, s in payload.items())
        assert est.loc[n, "comm_bytes_per_gpu"] == pytest.approx(want, abs=3)
