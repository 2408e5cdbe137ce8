"""A tiny amp run that several amp unit files share: a 4-6-2 MLP, ``amp.initialize`` of it in
bf16 (warnings silenced), and one scaled training step."""

from __future__ import annotations

import warnings

import torch

from mpnb import amp


def net() -> torch.nn.Sequential:
    """The 4-6-2 MLP, seeded."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


def initialize(level="O2", opt_cls=torch.optim.SGD, **kw):
    """``(model, optimizer)`` of :func:`net` through ``amp.initialize`` in bf16."""
    m = net()
    opt = opt_cls(m.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return amp.initialize(m, opt, opt_level=level, verbosity=0, half_dtype=torch.bfloat16, **kw)


def step(m, opt, scale_by=1.0, **kw) -> None:
    """One step on a random batch, the loss multiplied by ``scale_by`` (inf/NaN: an overflow)."""
    opt.zero_grad()
    with amp.scale_loss(m(torch.randn(3, 4)).float().pow(2).mean() * scale_by, opt, **kw) as s:
        s.backward()
    opt.step()
