"""The CUDA size of the built-in workloads: a pure function of a device's description, checked
here on made-up H100 / A100 / L4 / T4 descriptions; the fixed sizes and CPU auto unchanged."""

import pytest
import torch

from mpnb.lab import gpu_sizing as gs
from mpnb.lab import workloads
from mpnb.lab.gpu_sizing import GpuSpec, gpu_plans, peak_tflops

H100 = GpuSpec("NVIDIA H100 80GB HBM3", 85_520_000_000, (9, 0), 132)
A100 = GpuSpec("NVIDIA A100-SXM4-80GB", 85_100_000_000, (8, 0), 108)
L4 = GpuSpec("NVIDIA L4", 23_700_000_000, (8, 9), 58)
T4 = GpuSpec("Tesla T4", 15_800_000_000, (7, 5), 40, conv_tf32=False)
CARDS = (H100, A100, L4, T4)


def _params(spec: dict) -> int:
    return spec["layers"] * 12 * spec["d"] ** 2


def test_h100_gets_a_wide_deep_gpt_that_fits_and_computes():
    p = gpu_plans(H100)["transformer"]
    s = p.spec
    assert 1024 <= s["d"] <= 2048 and s["layers"] >= 12 and s["seq"] == 1024, s
    assert s["d"] % s["heads"] == 0 and s["d"] // s["heads"] == 128
    assert p.gpu_ms >= 2 * p.host_ms  # fp32 compute dominates the launches, 2x
    assert p.busy > 0.8
    assert p.memory_bytes <= gs.MEMORY_FRACTION * H100.total_memory  # 6 configurations
    assert p.compare_s <= 180 and gs.STEPS[0] <= s["steps"] <= gs.STEPS[1]
    # the docstring's arithmetic: 6 * params * tokens plus the attention
    tokens = s["batch"] * s["seq"]
    dense = 6 * _params(s) * tokens
    assert p.flops == pytest.approx(dense + 12 * s["layers"] * tokens * s["seq"] * s["d"], 0.01)


@pytest.mark.parametrize("gpu", CARDS, ids=lambda g: g.name)
def test_every_plan_fits_memory_and_time(gpu):
    for name, p in gpu_plans(gpu).items():
        assert p.memory_bytes <= gs.MEMORY_FRACTION * gpu.total_memory, (name, p)
        assert p.compare_s <= 180, (name, p)
        assert p.spec["batch"] >= 1 and p.spec["steps"] >= gs.STEPS[0]
        assert set(workloads.SIZES_SPEC[name]["small"]) <= set(p.spec) | {"scale"}, name


def test_a_smaller_card_gets_a_smaller_model():
    big, small = gpu_plans(H100)["transformer"], gpu_plans(T4)["transformer"]
    assert _params(small.spec) < _params(big.spec)
    assert small.memory_bytes < big.memory_bytes
    assert "memory" in small.why and big.why == ""  # T4: fewer layers, and it says why
    assert gpu_plans(L4)["transformer"].spec["layers"] < 12


def test_cnn_and_mlp_grow_with_the_card():
    h, t = gpu_plans(H100), gpu_plans(T4)
    assert h["cnn"].spec["batch"] > t["cnn"].spec["batch"] or h["cnn"].flops > t["cnn"].flops
    assert h["mlp"].spec["hidden"] > t["mlp"].spec["hidden"]
    for plans in (h, t):
        for name in ("cnn", "mlp"):
            assert plans[name].gpu_ms >= gs.BUSY_MARGIN * plans[name].host_ms, name


def test_peaks_published_or_estimated_from_the_sms():
    assert peak_tflops(H100)["fp32"] == 67.0 and "published" in peak_tflops(H100)["source"]
    assert peak_tflops(T4)["conv"] == peak_tflops(T4)["fp32"]  # no TF32 before Ampere
    assert peak_tflops(H100)["conv"] > 5 * peak_tflops(H100)["fp32"]  # cuDNN's TF32
    unknown = GpuSpec("Some Future GPU", 40_000_000_000, (9, 0), 100)
    twice = GpuSpec("Some Future GPU", 40_000_000_000, (9, 0), 200)
    assert "estimated" in peak_tflops(unknown)["source"]
    assert peak_tflops(twice)["fp32"] == pytest.approx(2 * peak_tflops(unknown)["fp32"])
    with pytest.raises(ValueError, match="total_memory"):
        gpu_plans(GpuSpec("NVIDIA H100", 0))


def test_fixed_sizes_and_cpu_auto_are_unchanged():
    assert workloads.size_spec("transformer", "medium") == dict(
        d=128, layers=4, seq=128, batch=32, steps=100, lr=2e-3
    )
    assert workloads.resolve_size("auto", "cpu") == "small"
    assert workloads.resolve_size(None, "cuda:1") == workloads.GPU_SIZE
    assert workloads.resolve_size("large", "cuda") == "large"
    assert workloads.get("mlp", "small").description == "MLP (hidden 128) on 8x8 digits"
    assert workloads.get("mlp", "small").model_fn().body[1].in_features == 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_gpu_size_without_cuda_says_what_to_do():
    with pytest.raises(ValueError, match="no CUDA device.*'small'"):
        workloads.get("transformer", "gpu")


def test_gpu_size_builds_the_planned_models(monkeypatch):
    small_card = GpuSpec("Made-up 6GB", 6_000_000_000, (8, 6), 20)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(GpuSpec, "of", classmethod(lambda cls, device="cuda": small_card))
    plans = gpu_plans(small_card)
    lm = workloads.get("transformer", "auto", "cuda")
    s = plans["transformer"].spec
    assert lm.size == "gpu" and (lm.batch_size, lm.steps, lm.lr) == (
        s["batch"],
        s["steps"],
        s["lr"],
    )
    model = lm.model_fn()
    assert len(model.blocks) == s["layers"] and model.blocks[0].heads == s["heads"]
    assert model.pos.num_embeddings == s["seq"] and model.tok.embedding_dim == s["d"]
    mlp = workloads.get("mlp", "gpu", "cuda:0")
    assert mlp.model_fn().body[1].in_features == 64 * 64 and "64x64" in mlp.description
    assert mlp.model_fn().body[1].out_features == plans["mlp"].spec["hidden"]
    assert "64x64" in workloads.get("cnn", "gpu", "cuda").description


def test_activation_estimate_matches_the_memory_tracker(monkeypatch):
    """The sizing's memory arithmetic against what the lab measures, on a GPT small enough
    for a CPU (same code path, 128 per head)."""
    import mpnb.lab

    d, layers, seq, batch = 256, 2, 256, 4
    monkeypatch.setattr(gs, "SEQ", seq)
    spec = dict(d=d, layers=layers, heads=d // 128, seq=seq, batch=batch, steps=4, lr=3e-4)
    monkeypatch.setitem(workloads.SIZES_SPEC["transformer"], "large", spec)
    df = mpnb.lab.compare(configs=("O0",), size="large", steps=4, progress=False, device="cpu")
    assert df.status[0] == "ok", df.error[0]
    flops, nbytes, _ = gs._gpt(d, layers, batch)
    params = sum(p.numel() for p in workloads.get("transformer", "large").model_fn().parameters())
    act_mib = (nbytes - gs.STATE_BYTES * params) / 2**20
    assert act_mib == pytest.approx(df.mem_activations_mib[0], rel=0.15)
    assert flops == pytest.approx(df.flops_per_step[0], rel=0.1)


@pytest.mark.gpu
def test_auto_on_this_gpu_is_sized_for_it():
    gpu = GpuSpec.of("cuda")
    assert gpu.total_memory > 0 and gpu.sm_count > 0
    w = workloads.get("transformer", "auto", "cuda")
    assert w.size == "gpu" and w.batch_size == gpu_plans(gpu)["transformer"].spec["batch"]
    assert gpu_plans(gpu)["transformer"].memory_bytes <= gpu.total_memory
