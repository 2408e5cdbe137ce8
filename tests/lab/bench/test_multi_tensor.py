"""The ``multi-tensor`` bench suite (``mpnb.lab.bench.multi_tensor``): its workloads, its cases
and their candidates, end to end at tiny sizes."""

from __future__ import annotations

import json

from mpnb.lab import bench
from mpnb.lab.bench import Options, multi_tensor
from mpnb.lab.bench._report import ALLOCATOR_ENV


def test_multi_tensor_quick_smoke(tmp_path, capsys):
    path = tmp_path / "mt.json"
    argv = ["multi-tensor", "--quick", "--rounds", "1", "--scale", "0.0005", "--json", str(path)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "# torch:" in out and "mpnb multi_tensor_scale" in out
    data = json.loads(path.read_text())
    header, rows = data["header"], data["rows"]
    for key in ("torch", "threads", "cpu", "isa", "allocator", "mpnb_kernels", "date"):
        assert key in header
    assert set(header["allocator"]) == set(ALLOCATOR_ENV)
    cases = {(r["case"], r["workload"]) for r in rows}
    assert len({w for _, w in cases}) == 3 and len(cases) >= 15
    cols = ("candidate", "role", "median_s", "iqr_s", "ratio", "target", "gbps", "bw_frac")
    for col in (*cols, "status", "preempt_per_call", "times_s"):
        assert all(col in r for r in rows)
    ours = [r for r in rows if r["candidate"].startswith("mpnb ")]
    assert ours and all(r["ratio"] > 0 and r["bw_frac"] > 0 for r in ours)
    assert any(r["status"] in ("PASS", "MISS") for r in ours)


def test_filter_selects_cases(capsys):
    res = bench.run_suite(
        "multi-tensor", Options.make(quick=True, rounds=1, scale=0.0005, filter="l2norm")
    )
    assert res.rows and all(r.case.startswith("l2norm") for r in res.rows)
    assert "l2norm" in res.table()


def test_gpt_numels_counts_a_small_gpts_parameters():
    d, vocab, ctx, layers = 384, 23_296, 1024, 6
    sizes = multi_tensor.gpt_numels()
    # embeddings; per block 2 norms, qkv, attention out, 2 norms, MLP in and out (with biases)
    per_block = 12 * d * d + 13 * d
    assert len(sizes) == 2 + 12 * layers + 2 == 76
    assert sum(sizes) == vocab * d + ctx * d + layers * per_block + 2 * d
    assert 19e6 < sum(sizes) < 21e6  # "GPT 20M/76"
    assert multi_tensor.gpt_numels(vocab=10, d=2, layers=1, ctx=3) == [
        *(20, 6),
        *(2, 2, 12, 6, 4, 2, 2, 2, 16, 8, 16, 2),
        *(2, 2),
    ]


#: bytes each element moves, per case: reads and writes of the tensors it touches
_BYTES_PER_ELEMENT = {
    "unscale bf16->fp32": 2 + 4,
    "inf/NaN check bf16": 2,
    "l2norm float32": 4,
    "scale fp32->fp32": 4 + 4,
    "axpby fp32": 4 + 4 + 4,
}


def test_every_workload_has_every_case_with_its_bytes_and_targets():
    scale = 0.0005
    found = list(multi_tensor.cases(Options.make(quick=True, scale=scale)))
    by = {(c.name, c.workload): c for c in found}
    assert len(by) == len(found) == len(multi_tensor.WORKLOADS) * len(_BYTES_PER_ELEMENT)
    for work, make in multi_tensor.WORKLOADS.items():
        n = sum(max(1, round(k * scale)) for k in make())
        for name, per in _BYTES_PER_ELEMENT.items():
            case = by[(name, work)]
            assert case.bandwidth_numel == n
            base, ours = case.candidates[0], case.candidates[-1]
            assert base.name.startswith("torch") and ours.name.startswith("mpnb multi_tensor_")
            assert base.bytes == ours.bytes == per * n  # both sides move the same bytes
    a, c = "(a) GPT 20M/76", "(c) 200x1k"
    assert by[("unscale bf16->fp32", a)].candidates[-1].target == 1.7
    assert by[("unscale bf16->fp32", c)].candidates[-1].target == 4.0
    ours = by[("inf/NaN check bf16", a)].candidates[-1]
    assert (ours.target, ours.bw_target) == (2.5, 0.80)
    assert by[("axpby fp32", c)].candidates[-1].bw_target is None  # targets on (a) only


def test_the_full_run_adds_a_bf16_l2norm_on_the_gpt_workload():
    quick = {(c.name, c.workload) for c in multi_tensor.cases(Options.make(quick=True, scale=1e-4))}
    full = {(c.name, c.workload) for c in multi_tensor.cases(Options.make(scale=1e-4))}
    assert full - quick == {("l2norm bfloat16", "(a) GPT 20M/76")}
