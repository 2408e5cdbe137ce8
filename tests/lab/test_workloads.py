"""Each built-in workload trains for real, at every size its memory is MiB, and data forms work."""

import pytest
import torch

import mpnb.lab
from mpnb.lab import workloads
from mpnb.lab._text import VOCAB, generate_tokens, lm_sequences
from mpnb.lab.stats import torch_threads


@pytest.fixture(autouse=True)
def one_thread():
    """One thread: on a shared 2-core machine that is several times faster (restored after)."""
    with torch_threads(1):
        yield


def test_sizes_scale_the_workloads():
    for name in workloads.names():
        params = [
            sum(p.numel() for p in workloads.get(name, s).model_fn().parameters())
            for s in workloads.SIZES
        ]
        assert params == sorted(params) and params[0] < params[-1], name
    assert workloads.get("transformer", "auto", "cpu").size == "small"
    assert workloads.resolve_size("auto", "cuda") == workloads.GPU_SIZE  # sized for the card
    with pytest.raises(ValueError, match="size"):
        workloads.get("cnn", "huge")
    assert workloads.names()[0] == "transformer"  # the default of compare, the CLI and widget


@pytest.mark.slow
@pytest.mark.parametrize("name,floor", [("transformer", 0.18), ("cnn", 0.9), ("mlp", 0.9)])
def test_default_workload_accuracy_is_well_above_chance_and_stable(name, floor):
    metrics = []
    for seed in (0, 1, 2):
        df = mpnb.lab.compare(name, opt_levels=("O0",), seed=seed, progress=False)
        assert df.status[0] == "ok", df.error[0]
        metrics.append(df.metric[0])
    w = workloads.get(name, "small")
    assert min(metrics) > floor > 5 * w.chance, metrics
    assert max(metrics) - min(metrics) < 0.05, metrics  # stable across seeds


@pytest.mark.slow
def test_default_transformer_memory_is_mib_and_halves_under_o3():
    df = mpnb.lab.compare(opt_levels=("O0", "O3"), steps=4, progress=False).set_index("opt_level")
    assert (df.status == "ok").all(), df.error.tolist()
    assert df.loc["O0", "peak_mem_mib"] > 5  # MiB, not KiB
    assert df.loc["O0", "mem_activations_mib"] > 4 * df.loc["O0", "mem_params_mib"]
    ratio = df.loc["O3", "mem_params_mib"] / df.loc["O0", "mem_params_mib"]
    assert ratio == pytest.approx(0.5, abs=0.01)


def test_default_cnn_memory_is_mib_scale():
    df = mpnb.lab.compare("cnn", opt_levels=("O0", "O2"), steps=4, progress=False)
    df = df.set_index("opt_level")
    assert (df.status == "ok").all(), df.error.tolist()
    assert df.loc["O0", "peak_mem_mib"] > 4  # MiB, not KiB (small: ~5 MiB, mostly activations)
    assert df.loc["O0", "mem_activations_mib"] > 10 * df.loc["O0", "mem_params_mib"]
    assert df.loc["O2", "mem_master_weights_mib"] > 0
    assert 1 < df.loc["O2", "peak_mem_mib"] < df.loc["O0", "peak_mem_mib"]  # bf16 activations


def test_generated_text_is_deterministic_and_grammatical():
    a, b = generate_tokens(500, seed=3), generate_tokens(500, seed=3)
    assert torch.equal(a, b) and not torch.equal(a, generate_tokens(500, seed=4))
    words = [VOCAB[i] for i in a]
    assert words.count(".") > 20
    x, y = lm_sequences(a, 24)
    assert x.shape == y.shape and torch.equal(x[0, 1:], y[0, :-1])


def test_custom_workload_accepts_every_data_form():
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    ds = torch.utils.data.TensorDataset(x, y)
    dl = torch.utils.data.DataLoader(ds, batch_size=16)
    gen = lambda: ((x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16))  # noqa: E731
    for data in ((x, y), ds, dl, gen, iter(list(gen()))):
        w = workloads.custom(lambda: torch.nn.Linear(8, 3), data, metric_fn=workloads.accuracy)
        bx, by = next(w.batches(16, seed=0))
        assert bx.shape == (16, 8) and by.shape == (16,)
        assert w.fixed_batch()[0].shape[1] == 8
    assert workloads.custom(lambda: torch.nn.Linear(8, 3), dl).batch_size == 16
    with pytest.raises(TypeError, match="DataLoader"):
        workloads.custom(lambda: torch.nn.Linear(8, 3), 42)


def test_logits_of_reads_any_output():
    z = torch.randn(2, 3)
    for out in (z, (z, z.sum()), {"logits": z}, {"h": z}):
        assert workloads.logits_of(out) is z
    assert workloads.accuracy((z,), z.argmax(-1)) == 1.0
