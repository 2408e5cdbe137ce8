"""The language-model workload: a deterministic toy grammar and a tiny GPT-style Transformer.

The text is generated, not downloaded: sentences of a small English-like grammar with
subject-verb agreement (``"every small robot chases the dogs near a farmer ."``), so a model
must learn real structure (which word classes follow which, singular vs plural) to predict
the next word. The same seed gives the same text on every machine.

The model uses mpnb's own fused layers (:class:`~mpnb.normalization.FusedLayerNorm`,
:class:`~mpnb.transformer.functional.FusedScaleMaskSoftmax`), so the lab measures them too.
"""

from __future__ import annotations

import math
import random

import torch
from torch import nn

from mpnb.core.normalization import FusedLayerNorm
from mpnb.core.transformer import AttnMaskType
from mpnb.core.transformer.functional import FusedScaleMaskSoftmax

__all__ = ["VOCAB", "generate_tokens", "TinyLM", "lm_sequences"]

_DET = {"s": ["the", "a", "every", "one"], "p": ["the", "some", "many", "two"]}
_NOUN = {
    "s": ["cat", "dog", "bird", "child", "robot", "farmer"],
    "p": ["cats", "dogs", "birds", "children", "robots", "farmers"],
}
_VERB = {
    "s": ["sees", "likes", "chases", "helps", "finds"],
    "p": ["see", "like", "chase", "help", "find"],
}
_ADJ = ["small", "red", "quick", "old", "happy"]
_PREP = ["near", "with", "behind"]
VOCAB = sorted(
    {w for d in (_DET, _NOUN, _VERB) for ws in d.values() for w in ws}
    | set(_ADJ)
    | set(_PREP)
    | {".", "and"}
)


def _noun_phrase(rng: random.Random, number: str) -> list[str]:
    words = [rng.choice(_DET[number])]
    if rng.random() < 0.4:
        words.append(rng.choice(_ADJ))
    return words + [rng.choice(_NOUN[number])]


def _sentence(rng: random.Random) -> list[str]:
    num = rng.choice("sp")
    words = _noun_phrase(rng, num) + [rng.choice(_VERB[num])]
    words += _noun_phrase(rng, rng.choice("sp"))
    if rng.random() < 0.3:
        words += [rng.choice(_PREP)] + _noun_phrase(rng, rng.choice("sp"))
    if rng.random() < 0.2:
        num = rng.choice("sp")
        words += ["and"] + _noun_phrase(rng, num) + [rng.choice(_VERB[num])]
        words += _noun_phrase(rng, rng.choice("sp"))
    return words + ["."]


def generate_tokens(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` token ids of generated text (ids index :data:`VOCAB`).

    Example::

        >>> " ".join(VOCAB[i] for i in generate_tokens(12))
    """
    rng = random.Random(seed)
    index = {w: i for i, w in enumerate(VOCAB)}
    out: list[int] = []
    while len(out) < n:
        out += [index[w] for w in _sentence(rng)]
    return torch.tensor(out[:n], dtype=torch.long)


def lm_sequences(tokens: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut ``tokens`` into non-overlapping ``(inputs, next-token targets)`` of ``seq_len``."""
    n = (len(tokens) - 1) // seq_len
    x = tokens[: n * seq_len].view(n, seq_len)
    y = tokens[1 : n * seq_len + 1].view(n, seq_len)
    return x, y


class _Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = FusedLayerNorm(d), FusedLayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.softmax = FusedScaleMaskSoftmax(
            False, False, AttnMaskType.causal, True, None, True, 1.0 / math.sqrt(d // heads)
        )
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # b, h, t, d/h
        att = self.softmax(q @ k.transpose(-1, -2), None)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A GPT-style causal language model: embeddings, pre-norm blocks, a linear head.

    Args:
        vocab: vocabulary size.
        seq_len: the longest input (learned positions).
        d: model width; heads: attention heads; layers: blocks.

    Example::

        >>> TinyLM(len(VOCAB), 16)(torch.zeros(2, 16, dtype=torch.long)).shape
        torch.Size([2, 16, 48])
    """

    def __init__(self, vocab: int, seq_len: int, d: int = 32, heads: int = 2, layers: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.Sequential(*[_Block(d, heads) for _ in range(layers)])
        self.ln, self.head = FusedLayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        return self.head(self.ln(self.blocks(x)))
