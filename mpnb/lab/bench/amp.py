"""amp: O1 step vs autocast+GradScaler, O2 optimizer side, O2 vs O1 forward, amp's overhead.

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
* ``amp overhead``: 200 one-element params, zero grads: ``zero_grad`` + grads + SGD ``step``
  with the device work of amp's step called bare (flag reset, loss * scale, the unscale and
  scale update, the one host read) vs the same step inside ``amp.scale_loss`` under O1. The
  difference is the Python that ``scale_loss`` + ``step`` add on top of the kernels they call
  (target: at most 50 us, ``max_extra_s``). The step without loss scaling and with
  ``torch.amp.GradScaler`` are shown for reference.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch

from mpnb.lab.bench._harness import Candidate, Case, Options

__all__ = ["cases"]

_LR = 1e-9


def _amp_init(model, opt, level, half):
    from mpnb import amp
    from mpnb.core.amp import EmulatedHalfWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedHalfWarning)
        return amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0)


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


def _overhead_case(dev) -> Case:
    from mpnb import amp
    from mpnb.core.ops._registry import unscale_grads

    def params():
        return [torch.nn.Parameter(torch.zeros(1, device=dev)) for _ in range(200)]

    zeros = [torch.zeros(1, device=dev) for _ in range(200)]
    loss = torch.zeros((), device=dev)

    def plain(with_kernels: bool):
        ps = params()
        opt = torch.optim.SGD(ps, lr=_LR, foreach=True)
        # The device work of amp's step, called bare: amp's own scaler tensors and calls.
        packed = torch.zeros(3, device=dev)
        scale, inv, found = packed.split(1)
        scale.fill_(2.0**16)
        torch.reciprocal(scale, out=inv)
        growth = torch.zeros(1, dtype=torch.int32, device=dev)
        hyst = torch.ones(1, dtype=torch.int32, device=dev)
        update = (scale, growth, hyst, 2.0, 0.5, 2000, 1, 0.0, 2.0**24)

        def step():
            opt.zero_grad()
            if with_kernels:
                found.zero_()
                loss * scale  # noqa: B018 - the scaled loss a backward would start from
            for p, g in zip(ps, zeros, strict=True):
                p.grad = g
            if with_kernels:
                unscale_grads(ps, found, inv, update)
                packed.tolist()  # the step's one host read
            opt.step()

        return step

    holder = torch.nn.Module()
    holder.ps = torch.nn.ParameterList(params())
    opt = torch.optim.SGD(holder.parameters(), lr=_LR, foreach=True)
    holder, opt = _amp_init(holder, opt, "O1", torch.bfloat16)
    amp_params = list(holder.parameters())

    def amp_step():
        opt.zero_grad()
        with amp.scale_loss(loss, opt):
            for p, g in zip(amp_params, zeros, strict=True):
                p.grad = g
        opt.step()

    gs_params = params()
    gs_opt = torch.optim.SGD(gs_params, lr=_LR, foreach=True)
    scaler = torch.amp.GradScaler(dev.type)

    def grad_scaler_step():
        gs_opt.zero_grad()
        scaler.scale(loss)
        for p, g in zip(gs_params, zeros, strict=True):
            p.grad = g
        scaler.step(gs_opt)
        scaler.update()

    return Case(
        "amp overhead",
        "200 x 1-element params, SGD foreach, O1",
        [
            Candidate("step + amp's kernels called bare", plain(True)),
            Candidate("step + amp.scale_loss (amp)", amp_step, max_extra_s=50e-6),
            Candidate("step, no loss scaling (reference)", plain(False)),
            Candidate("step + torch GradScaler (reference)", grad_scaler_step),
        ],
        min_rounds=40,
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
    yield _overhead_case(dev)
