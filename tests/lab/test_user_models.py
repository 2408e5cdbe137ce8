"""Your own model in one call: HF tiny configs, a CNN, any output type, any data form, errors."""

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import mpnb.lab
from mpnb.lab import workloads
from mpnb.lab.hf import hf_accuracy, hf_loss, transformers_workload

LEVELS = ("O0", "O1", "O2", "O3", "torch-amp")  # compare's default on a CPU


def _ids(n=64, t=16, seed=0):
    return torch.randint(0, 64, (n, t), generator=torch.Generator().manual_seed(seed))


def _quiet_transformers():
    tr = pytest.importorskip("transformers")
    tr.utils.logging.set_verbosity_error()
    return tr


def _gpt2():
    tr = _quiet_transformers()
    cfg = tr.GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return lambda: tr.GPT2LMHeadModel(cfg)


def _bert():
    tr = _quiet_transformers()
    cfg = tr.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
    )
    return lambda: tr.BertForSequenceClassification(cfg)


def test_hf_gpt2_every_level_passes_model_output_to_loss_fn():
    make = _gpt2()
    seen = []

    def loss_fn(out, labels):
        seen.append(type(out).__name__)
        return hf_loss(out)

    w = transformers_workload(make, _ids(), batch_size=8)
    w = workloads.custom(make, w.train, loss_fn, w.metric_fn, batch_size=8, name="gpt2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = mpnb.lab.compare(w, steps=4, progress=False, threads=1)
    assert (df.status == "ok").all(), df.error.tolist()
    assert list(df.opt_level) == list(LEVELS) and df.metric.notna().all()
    assert df.output_diff_vs_O0[1:].gt(0).all() and (df.flops_per_step > 0).all()
    assert "CausalLMOutputWithCrossAttentions" in seen  # what the model returned, not a tensor
    assert not [c for c in caught if "backward hooks" in str(c.message)]


def test_hf_bert_classifier_in_one_call():
    make = _bert()
    y = torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(1))
    df = mpnb.lab.compare(
        transformers_workload(make, (_ids(), y), batch_size=8), steps=4, progress=False, threads=1
    )
    assert (df.status == "ok").all(), df.error.tolist()
    assert df.metric_name[0] == "accuracy" and df.metric.between(0, 1).all()


def test_hf_accuracy_shifts_causal_labels_and_ignores_minus_100():
    logits = torch.zeros(1, 4, 5)
    logits[0, torch.arange(4), torch.tensor([1, 2, 3, 0])] = 1.0
    labels = torch.tensor([[9, 1, 2, -100]])
    assert hf_accuracy({"logits": logits}, labels, causal=True) == 1.0
    assert hf_accuracy((torch.tensor(0.5), logits), torch.tensor([[1, 2, 3, 4]])) == 0.75
    with pytest.raises(ValueError, match="no loss"):
        hf_loss({"logits": logits})


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    aux: torch.Tensor


class _Multi(nn.Module):
    """Returns its logits as a tensor, tuple, dict or dataclass."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.lin = kind, nn.Linear(8, 3)

    def forward(self, x):
        z = self.lin(x)
        return {
            "tensor": z,
            "tuple": (z, z.sum()),
            "dict": {"logits": z, "aux": z.sum()},
            "dataclass": _Out(z, z.sum()),
        }[self.kind]


@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict", "dataclass"])
def test_output_types_reach_loss_fn_unchanged(kind):
    x = torch.randn(64, 8)
    y = x[:, :3].argmax(1)
    types = set()

    def loss_fn(out, target):
        types.add(type(out))
        return nn.functional.cross_entropy(workloads.logits_of(out).float(), target)

    df = mpnb.lab.compare(
        lambda: _Multi(kind),
        (x, y),
        loss_fn=loss_fn,
        metric_fn=workloads.accuracy,
        steps=3,
        progress=False,
        threads=1,
    )
    # every level hands loss_fn the model's own output type, casts applied inside it
    assert (df.status == "ok").all(), df.error.tolist()
    expected = {"tensor": torch.Tensor, "tuple": tuple, "dict": dict, "dataclass": _Out}[kind]
    assert types == {expected} and df.metric.notna().all()


class TinyCNN(nn.Module):
    """A torchvision-free CNN for 1x12x12 images."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 2),
        )

    def forward(self, x):
        return self.net(x)


def _images(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 12, 12, generator=g)
    return x, (x.mean((1, 2, 3)) > 0).long()


def test_cnn_with_a_dataloader_generator_function_and_iterator():
    x, y = _images()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    gen_fn = lambda: ((x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16))  # noqa: E731
    iterator = iter([(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)])
    for data in (loader, gen_fn, iterator):
        df = mpnb.lab.compare(
            TinyCNN,
            data,
            metric_fn=workloads.accuracy,
            eval_data=_images(32, 1),
            opt_levels=("O0", "O2"),
            steps=5,
            progress=False,
            threads=1,
        )
        assert (df.status == "ok").all(), df.error.tolist()
        assert list(df.batch_size) == [16, 16] and (df.mem_activations_mib > 0).all()
    with pytest.raises(ValueError, match="fixes the batch size"):
        mpnb.lab.compare(TinyCNN, loader, batch_sizes=(8,), progress=False)


class _Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x):
        if self.lin.weight.dtype == torch.bfloat16:
            raise RuntimeError("user code cannot take bf16")
        return self.lin(x)


def test_user_errors_become_rows_naming_configuration_and_frame():
    x = torch.randn(32, 8)
    df = mpnb.lab.compare(
        _Boom, (x, (x[:, 0] > 0).long()), steps=3, progress=False, threads=1
    ).set_index("opt_level")
    assert df.loc["O0", "status"] == "ok" and df.loc["O1", "status"] == "ok"
    for lvl in ("O2", "O3"):
        err = df.loc[lvl, "error"]
        assert err.startswith(f"{lvl} bf16 b") and "user code cannot take bf16" in err
        assert "test_user_models.py" in err and "in forward" in err
    with pytest.raises(TypeError, match="function returning a fresh model"):
        mpnb.lab.compare(_Boom(), (x, x))
