"""Each built-in workload trains for real: the loss falls and the metric beats chance widely."""

import pytest
import torch

from mpnb.lab import workloads
from mpnb.lab._text import VOCAB, generate_tokens, lm_sequences
from mpnb.lab._train import run_config
from mpnb.lab.config import expand


@pytest.fixture(autouse=True)
def one_thread():
    """One thread: on a shared 2-core machine that is several times faster (restored after)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _train(name, level="O0", steps=None, half="bf16"):
    w = workloads.get(name)
    cfg = expand(name, (level,), half, (w.batch_size,), steps=steps or w.steps)[0]
    res = run_config(cfg, w)
    assert res.error is None, res.error
    losses = [h["loss"] for h in res.history]
    return w, res, sum(losses[:5]) / 5, sum(losses[-10:]) / 10


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,steps,floor", [("mlp", 80, 0.85), ("cnn", 100, 0.8), ("transformer", 150, 0.18)]
)
def test_builtin_workload_trains(name, steps, floor):
    w, res, first, last = _train(name, steps=steps)
    assert last < 0.6 * first, (first, last)
    assert res.row["metric"] > floor > 3 * w.chance, res.row["metric"]
    if name == "transformer":  # perplexity well below the vocabulary size (48)
        assert torch.tensor(res.row["eval_loss"]).exp() < 12


@pytest.mark.slow
def test_transformer_trains_in_bf16_o2():
    w, res, first, last = _train("transformer", "O2", steps=40)
    assert last < 0.8 * first
    assert res.row["mem_master_weights_mib"] > 0


def test_generated_text_is_deterministic_and_grammatical():
    a, b = generate_tokens(500, seed=3), generate_tokens(500, seed=3)
    assert torch.equal(a, b) and not torch.equal(a, generate_tokens(500, seed=4))
    words = [VOCAB[i] for i in a]
    assert words.count(".") > 20
    x, y = lm_sequences(a, 24)
    assert x.shape == y.shape and torch.equal(x[0, 1:], y[0, :-1])


def test_custom_workload_accepts_tensors_dataset_and_dataloader():
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    ds = torch.utils.data.TensorDataset(x, y)
    dl = torch.utils.data.DataLoader(ds, batch_size=16)
    for data in ((x, y), ds, dl):
        w = workloads.custom(
            lambda: torch.nn.Linear(8, 3),
            data,
            torch.nn.functional.cross_entropy,
            workloads.accuracy,
        )
        bx, by = next(w.batches(16, seed=0))
        assert bx.shape == (16, 8) and by.shape == (16,)
        assert w.fixed_batch()[0].shape[1] == 8
    with pytest.raises(TypeError, match="Dataset"):
        next(
            workloads.custom(
                lambda: torch.nn.Linear(8, 3), [1, 2, 3], torch.nn.functional.cross_entropy
            ).batches(4, 0)
        )
