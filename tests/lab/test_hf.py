"""``mpnb.lab.hf``: Hugging Face models (tiny GPT-2 and BERT configs) in one call, and the
loss and accuracy read from their outputs."""

import warnings

import pytest
import torch

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
