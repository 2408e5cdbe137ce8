"""amp: O1 step vs autocast+GradScaler, O2 optimizer side, O2 vs O1 forward, scaler cost.

Cases (baseline first; ``ratio`` above 1 means faster than the baseline):

* ``O1 train step``: a 3-layer MLP step under ``torch.autocast`` + ``torch.amp.GradScaler``
  vs ``mpnb.amp`` O1 (target: at most 5% slower, ratio >= 0.95).
* ``O2 optimizer side``: 100 Linear(64,64) (200 tensors), fp16 grads preset; PyTorch's
  GradScaler with fp32 master copies by hand (copy grads, unscale, step, copy back) vs amp's
  ``scale_loss`` exit + ``step()`` with mpnb's FusedAdam through the fused seam (target: a
  quarter of the time, ratio >= 4); with torch Adam (no fused seam) for reference.
* ``forward``: 100 Linear(256,256), batch 32, no grad: O1 (autocast) vs O2 (half weights),
  target ratio >= 2; fp32 shown for reference. On a CPU without native bf16/fp16 both
  half paths are emulated: the matmul dominates and the target measures that, not amp.
* ``optimizer side``: 100 Linear(64,64) (200 params), SGD foreach, grads preset: a step with
  no loss scaling (baseline) vs the same step with ``torch.amp.GradScaler`` and with
  ``mpnb.amp`` O1 (fp16 dynamic scaling for both). What each adds to the bare step is its
  whole optimizer-side cost (scale the loss, unscale and check every grad, update the scale,
  step hooks, one host read); target: amp adds at most half of what GradScaler adds
  (``extra_ratio <= 0.5``, the median of per-round ratios).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch

from mpnb.lab.bench._harness import Candidate, Case, Options

__all__ = ["cases"]

_LR = 1e-9


def _amp_init(model, opt, level, half, **kwargs):
    from mpnb import amp
    from mpnb.core.amp import EmulatedHalfWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedHalfWarning)
        return amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0, **kwargs)


def _mlp(width: int, depth: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _o1_step_case(half, dev) -> Case:
    from mpnb import amp

    x = torch.randn(16, 64, device=dev)
    ref = _mlp(64, 3).to(dev)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=_LR)
    scaler = torch.amp.GradScaler(dev.type)

    def torch_step():
        ref_opt.zero_grad()
        with torch.autocast(dev.type, dtype=half):
            loss = ref(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(ref_opt)
        scaler.update()

    model = _mlp(64, 3).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=_LR)
    model, opt = _amp_init(model, opt, "O1", half)

    def mpnb_step():
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    return Case(
        "O1 train step",
        f"MLP 3xLinear(64,64) b16 {_name(half)}",
        [
            Candidate("torch.autocast + GradScaler", torch_step),
            Candidate("mpnb.amp O1", mpnb_step, target=0.95),
        ],
    )


def _name(dtype) -> str:
    return str(dtype).split(".")[-1]


def _grads(params, half):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(p.shape, generator=g) * 64).to(half).to(p.device) for p in params]


class _TorchMasters:
    """GradScaler + fp32 master copies by hand: what a PyTorch user writes for O2."""

    def __init__(self, model, half, dev):
        self.params = [p for p in model.parameters()]
        self.grads = _grads(self.params, half)
        self.masters = [torch.nn.Parameter(p.detach().float()) for p in self.params]
        for m in self.masters:
            m.grad = torch.empty_like(m)
        self.opt = torch.optim.Adam(self.masters, lr=_LR)
        self.scaler = torch.amp.GradScaler(dev.type, init_scale=64.0)
        self.scaler.scale(torch.ones((), device=dev))

    def __call__(self):
        torch._foreach_copy_([m.grad for m in self.masters], self.grads)
        self.scaler.step(self.opt)  # unscale_ + finite check + (maybe) step
        self.scaler.update()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)


class _AmpO2:
    """amp O2: the ``scale_loss`` exit (unscale into masters) and ``step()``; grads preset."""

    def __init__(self, model, opt, half):
        from mpnb import amp

        self.amp, self.opt = amp, opt
        self.params = [p for p in model.parameters()]
        self.grads = _grads(self.params, half)
        self.loss = torch.ones((), device=self.params[0].device)

    def __call__(self):
        with self.amp.scale_loss(self.loss, self.opt):
            for p, g in zip(self.params, self.grads, strict=True):
                p.grad = g  # what backward would leave
        self.opt.step()


def _o2_optimizer_case(half, dev) -> Case:
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(100)]).to(dev)

    base = net().to(half)
    cands = [Candidate("GradScaler + fp32 masters by hand (Adam)", _TorchMasters(base, half, dev))]
    m = net()
    m, o = _amp_init(m, torch.optim.Adam(m.parameters(), lr=_LR), "O2", half)
    # Reference: amp's fused seam needs a fused optimizer; torch Adam pays its per-tensor cost.
    cands.append(Candidate("mpnb.amp O2 + torch Adam (reference)", _AmpO2(m, o, half)))
    try:
        from mpnb.optimizers import FusedAdam
    except ImportError:
        FusedAdam = None  # noqa: N806
    if FusedAdam is not None:
        m = net()
        m, o = _amp_init(m, FusedAdam(m.parameters(), lr=_LR, adam_w_mode=False), "O2", half)
        cands.append(Candidate("mpnb.amp O2 + mpnb FusedAdam", _AmpO2(m, o, half), target=4.0))
    return Case("O2 optimizer side", f"100xLinear(64,64) 200 tensors {_name(half)}", cands)


def _forward_case(half, dev, layers: int) -> Case:
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(layers)]).to(dev)

    x = torch.randn(32, 256, device=dev)
    o1 = _amp_init(net(), None, "O1", half)
    o2 = _amp_init(net(), None, "O2", half)
    fp32 = net()

    def run(model):
        def call():
            with torch.no_grad():
                return model(x)

        return call

    return Case(
        "forward",
        f"{layers}xLinear(256,256) b32 no_grad {_name(half)}",
        [
            Candidate("mpnb.amp O1 (autocast)", run(o1)),
            Candidate("mpnb.amp O2 (half weights)", run(o2), target=2.0),
            Candidate("fp32, no amp (reference)", run(fp32)),
        ],
    )


def _optimizer_side_case(dev) -> Case:
    """amp's optimizer-side cost per step against ``torch.amp.GradScaler``'s, side by side.

    100 x Linear(64,64) (200 params), fp32 weights, SGD (foreach); the grads a backward would
    leave are assigned (the backward itself is the same for both and left out). The baseline
    is that step with no loss scaling; each candidate adds its scaler's whole per-step cost:
    scaling the loss, the unscale and finite check of every grad, the scale update, the step
    hooks and the one host read. fp16's dynamic scaling for both (bf16 needs none).
    """
    from mpnb import amp

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(100)]).to(dev)

    def grads(params):
        g = torch.Generator().manual_seed(3)
        return [torch.randn(p.shape, generator=g).to(dev) for p in params]

    loss = torch.ones((), device=dev)

    bare = model()
    bare_params = list(bare.parameters())
    bare_grads = grads(bare_params)
    bare_opt = torch.optim.SGD(bare_params, lr=_LR, foreach=True)

    def bare_step():
        bare_opt.zero_grad()
        for p, g in zip(bare_params, bare_grads, strict=True):
            p.grad = g
        bare_opt.step()

    gs = model()
    gs_params = list(gs.parameters())
    gs_grads = grads(gs_params)
    gs_opt = torch.optim.SGD(gs_params, lr=_LR, foreach=True)
    scaler = torch.amp.GradScaler(dev.type, init_scale=1.0, growth_interval=10**9)
    grad_scaler = "torch.amp.GradScaler (fp16 dynamic)"

    def grad_scaler_step():
        gs_opt.zero_grad()
        scaler.scale(loss)
        for p, g in zip(gs_params, gs_grads, strict=True):
            p.grad = g
        scaler.step(gs_opt)
        scaler.update()

    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=_LR, foreach=True)
    # GradScaler's settings above: a scale of 1 that never grows, so the preset grads (the
    # "scaled" grads, unscaled in place each step) stay the same finite values every step.
    rule = dict(init_scale=1.0, growth_interval=10**9)
    m, opt = _amp_init(m, opt, "O1", torch.float16, loss_scale=rule)
    amp_params = list(m.parameters())
    amp_grads = grads(amp_params)

    def amp_step():
        opt.zero_grad()
        with amp.scale_loss(loss, opt):
            for p, g in zip(amp_params, amp_grads, strict=True):
                p.grad = g
        opt.step()

    return Case(
        "optimizer side",
        "100xLinear(64,64) 200 params, SGD foreach, fp16 scaling",
        [
            Candidate("step, no loss scaling", bare_step),
            Candidate(grad_scaler, grad_scaler_step),
            Candidate(
                "mpnb.amp O1 (scale_loss + step)",
                amp_step,
                extra_vs=grad_scaler,
                max_extra_ratio=0.5,
            ),
        ],
        min_rounds=31,
    )


def cases(opts: Options) -> Iterator[Case]:
    """The amp suite's cases (see the module docstring)."""
    dev = torch.device(opts.device)
    half = torch.float16 if dev.type == "cuda" else torch.bfloat16
    yield _o1_step_case(half, dev)
    yield _o2_optimizer_case(torch.float16, dev)
    if dev.type == "cpu":
        yield _o2_optimizer_case(torch.bfloat16, dev)
    yield _forward_case(half, dev, max(1, int(100 * opts.scale)))
    yield _optimizer_side_case(dev)
