"""Fused optimizers: the one-pass O2 step (bf16 grads, fp32 masters) and fp32 steps vs PyTorch.

Two workloads: (a) a small GPT's ~20M parameters in 76 tensors, (d) 100 Linear(64, 64) layers
(200 tensors). The O2 baseline is PyTorch's path with the same copies: ``_foreach_copy_`` of
the bf16 grads into fp32 master grads, ``_amp_foreach_non_finite_check_and_unscale_``, the
optimizer (``fused=True`` where PyTorch has one) on the masters, ``_foreach_copy_`` back into
the bf16 params. Ours is one ``step()`` after ``_mpnb_set_scale`` (finite pre-pass included).
LAMB and NovoGrad have no PyTorch optimizer: their baseline runs mpnb's plain-PyTorch
references. Learning rates are tiny so that repeated steps do the same work.

``bytes`` is the least memory traffic of one step, the same for both sides. An update pass
reads and writes each array once (bf16 O2 AdamW: bf16 grad 2 + fp32 master, m, v 3 x 8 +
bf16 param 2 = 28 B/param; SGD, Adagrad, NovoGrad: 20; fp32 AdamW: 28). An O2 step with a loss
scale must also read the grads once before it may write anything (the overflow verdict; for
LAMB the global grad norm, for NovoGrad the per-tensor norms, which flag overflow too): +2
B/param with bf16 grads (:data:`PREPASS`), on both sides (PyTorch's path unscales and checks).
LAMB's trust ratio needs the norm of a tensor's whole update before any of its weights may be
written, so a tensor too large for the cache is streamed twice: its second pass reads w and
u (stored by the first, 4 written + 4 read) or w, m, v again, 12 B/param either way, and no
kernel avoids it for the params beyond the last-level cache's hold of w and u (8 B each):
+12 B for each of a tensor's params beyond ``llc / 8`` (:func:`lamb_second_pass`; the GPT's
8.9M-element embedding, not its 0.6M matrices, with an 8 MiB L3). Not counted:
read-for-ownership of written lines.

fp32 steps without masters: AdamW against ``AdamW(fused=True)`` and ``foreach=True`` (28
B/param), SGD momentum, Adagrad, LAMB and NovoGrad against PyTorch's fused optimizer or
mpnb's references (bytes: :data:`_FP32`).

Pure bf16 (no masters, no loss scale): ``FusedAdam(stochastic_rounding=True)`` and
``FusedAdam(kahan_summation=True)`` against PyTorch's ``AdamW(fused=True)`` on the same bf16
params (which keeps its moments in bf16: 14 B/param) and against our round-to-nearest bf16
step. Ours move :data:`PURE_BF16_BYTES` per param: bf16 param read + write 4, bf16 grad 2,
fp32 m and v read + write 16 (22 B); Kahan adds its bf16 compensation read + write (26 B).
Each of our three steps has a target: the share of the same-run in-place bandwidth
(``bw_target``), not a speed-up.

Every mpnb candidate with a bandwidth target also has its in-cache roofline (``InCache``): the
same optimizer's step over 4 fresh tensors that together fit in half of the last-level cache,
and over a sixteenth of that, so that the Python and dispatch cost of a step (~0.1 ms, more
than an L2-sized step's arithmetic) cancels. Steps below the multi-tensor ops'
``kSerialElems`` stay on one thread, so the slices are one core's and so is their throughput,
times the run's threads (:class:`InCache` ``one_thread``). Below 70% of the same-run bandwidth
the step cannot reach 70% from memory either: it is compute-bound at its arithmetic on this
CPU.

Every case also times PyTorch's compiled-optimizer recipe: ``torch.compile`` of a function
that calls ``step()`` of a ``torch.optim`` optimizer made without ``fused``/``foreach`` (so the
compiler generates the update), on its own copy of the params; in the O2 cases the whole copy,
unscale, step, copy path is compiled. Its compile time is reported apart; ``--no-compile``
skips it. LAMB and NovoGrad have none: PyTorch has no such optimizer to compile, and mpnb's
references (written for parity, with a host read per tensor) break the graph once per tensor,
which runs into dynamo's recompile limit.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mpnb.core.ops.lamb import reference_fused_lamb_
from mpnb.core.ops.novograd import reference_fused_novograd_
from mpnb.core.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from mpnb.lab.bench._harness import RMW, Candidate, Case, InCache, Options, compiled, llc_bytes
from mpnb.lab.bench.multi_tensor import gpt_numels

__all__ = ["cases", "WORKLOADS", "lamb_second_pass"]

_A, _D = "(a) GPT 20M/76", "(d) 100xLinear(64,64)"
WORKLOADS = {_A: lambda: gpt_numels(), _D: lambda: [64 * 64, 64] * 100}
_LR = 1e-9
PREPASS = 2  # B/param: the O2 step's read-only pass over the bf16 grads before any write
#: B/param of a pure-bf16 AdamW step: param r/w 2+2, grad 2, m and v r/w 4+4+4+4 (+ Kahan's
#: bf16 compensation r/w 2+2). PyTorch's bf16 AdamW keeps bf16 moments: 2+2+2+4*2 = 14.
PURE_BF16_BYTES = {"nearest": 22, "stochastic": 22, "kahan": 26, "torch": 14}
PURE_BF16_BW_TARGET = 0.8


#: Below this many elements a multi-tensor op runs on one thread (``kSerialElems`` in
#: csrc/cpu/multi_tensor_apply.h): the in-cache slices stay below it.
SERIAL_ELEMS = 1 << 17


def lamb_second_pass(numels) -> int:
    """The least traffic of LAMB's second pass over tensors of ``numels`` elements: 12 B for
    each param of a tensor beyond the ``llc / 8`` whose w and u (4 B each) the last-level cache
    can hold from the first pass (the module's docstring); 0 where the cache size is not
    known (the one-pass count, a lower bound)."""
    llc = llc_bytes()
    if llc is None:
        return 0
    return 12 * sum(max(0, n - llc // 8) for n in numels)


def _step_bytes(name: str, bpp: int, numels) -> int:
    """The least bytes of one ``name`` step over tensors of ``numels`` elements at ``bpp``
    B/param: one pass, plus LAMB's second pass (:func:`lamb_second_pass`)."""
    return bpp * sum(numels) + (lamb_second_pass(numels) if name == "LAMB" else 0)


def _in_cache(make, bpp: int) -> InCache | None:
    """The roofline of a step: ``make(numels)`` (a zero-argument step over fresh params of
    those sizes) on 4 tensors that fit in half of the last-level cache (one thread's, below
    :data:`SERIAL_ELEMS`) and on a sixteenth of that (see :class:`InCache` ``one_thread``);
    None where the cache size is not known."""
    llc = llc_bytes()
    if llc is None:
        return None
    k = min(SERIAL_ELEMS - 1, llc // 2 // bpp)
    big, small = [max(1, k // 4)] * 4, [max(1, k // 64)] * 4
    return InCache(make(big), bpp * sum(big), make(small), bpp * sum(small), one_thread=True)


def _params(numels, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in numels:
        p = torch.nn.Parameter(torch.randn(n, generator=g).to(dtype))
        p.grad = (torch.randn(n, generator=g) * 1024).to(dtype)
        out.append(p)
    return out


class _TorchO2:
    """PyTorch's O2 step: copy + unscale grads, ``opt`` on fp32 masters, copy back."""

    def __init__(self, model, make_opt, scaler: bool = False):
        self.model = model
        self.masters = [torch.nn.Parameter(p.detach().float()) for p in model]
        for m in self.masters:
            m.grad = torch.empty_like(m)
        self.opt = make_opt(self.masters)
        self.found = torch.zeros(1)
        self.inv = torch.full((1,), 1 / 1024)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaler else None
        if self.scaler is not None:
            self.scaler.scale(torch.ones(()))  # initialize its state

    def __call__(self):
        grads = [m.grad for m in self.masters]
        torch._foreach_copy_(grads, [p.grad for p in self.model])
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found, self.inv)
            self.opt.step()
        torch._foreach_copy_([p.detach() for p in self.model], self.masters)


class _OursO2:
    def __init__(self, model, make_opt):
        self.opt = make_opt(model)
        self.found, self.inv = torch.zeros(1), torch.full((1,), 1 / 1024)

    def __call__(self):
        self.opt._mpnb_set_scale(self.inv, self.found)
        self.opt.step()


class _RefOpt:
    """A torch-ops LAMB/NovoGrad (mpnb's references) behind the optimizer interface."""

    def __init__(self, params, kind):
        self.params, self.kind = params, kind
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.vn = [torch.zeros(()) for _ in params]
        self.steps = [torch.zeros(()) for _ in params]

    @torch.no_grad()
    def step(self):
        ps, gs = self.params, [p.grad for p in self.params]
        if self.kind == "lamb":
            norm = torch.stack([g.norm() for g in gs]).norm().reshape(1)
            reference_fused_lamb_(
                ps,
                gs,
                self.m,
                self.v,
                [],
                self.steps,
                norm,
                lr=_LR,
                beta1=0.9,
                beta2=0.999,
                eps=1e-6,
                weight_decay=0.01,
            )
        else:
            norms = torch.stack([g.norm() for g in gs])
            reference_fused_novograd_(
                ps,
                gs,
                self.m,
                self.vn,
                [],
                self.steps,
                norms,
                lr=_LR,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.0,
            )


_O2 = {  # name -> (torch optimizer on masters, ours with master weights, update bytes/param)
    "AdamW": (
        lambda p: torch.optim.AdamW(p, lr=_LR, weight_decay=0.01, fused=True),
        lambda p: FusedAdam(p, lr=_LR, weight_decay=0.01, master_weights=True),
        28,
    ),
    "SGD momentum": (
        lambda p: torch.optim.SGD(p, lr=_LR, momentum=0.9, fused=True),
        lambda p: FusedSGD(
            p, lr=_LR, momentum=0.9, master_weights=True, materialize_master_grads=False
        ),
        20,
    ),
    "Adagrad": (
        lambda p: torch.optim.Adagrad(p, lr=_LR, fused=True),
        lambda p: FusedAdagrad(p, lr=_LR, master_weights=True),
        20,
    ),
    "LAMB": (lambda p: _RefOpt(p, "lamb"), lambda p: FusedLAMB(p, lr=_LR, master_weights=True), 28),
    "NovoGrad": (
        lambda p: _RefOpt(p, "novograd"),
        lambda p: FusedNovoGrad(p, lr=_LR, master_weights=True),
        20,
    ),
}
_TARGETS = {("AdamW", _A): 1.6, ("AdamW", _D): 5.0}
#: fp32 steps without masters: name -> (ours, bytes/param). The update pass's least traffic
#: (SGD, Adagrad, NovoGrad: param r/w 8 + grad 4 + one fp32 state r/w 8 = 20; LAMB: two
#: states, 28) plus, for LAMB and NovoGrad, the read of the fp32 grads their norms need
#: before the update (+4). The baseline is PyTorch's fused optimizer (``_O2``'s, on the
#: params themselves) or, for LAMB and NovoGrad, mpnb's references.
_FP32 = {
    "SGD momentum": (lambda p: FusedSGD(p, lr=_LR, momentum=0.9), 20),
    "Adagrad": (lambda p: FusedAdagrad(p, lr=_LR), 20),
    "LAMB": (lambda p: FusedLAMB(p, lr=_LR), 28 + 4),
    "NovoGrad": (lambda p: FusedNovoGrad(p, lr=_LR), 20 + 4),
}
#: The optimizers ``torch.compile`` is given: PyTorch's own without ``fused`` (the compiled
#: recipe's); none for LAMB and NovoGrad, which PyTorch lacks.
_COMPILED = {
    "AdamW": lambda p: torch.optim.AdamW(p, lr=_LR, weight_decay=0.01),
    "SGD momentum": lambda p: torch.optim.SGD(p, lr=_LR, momentum=0.9),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=_LR),
}


def _compiled_step(opt, bytes: int, what: str = "AdamW.step") -> Candidate:
    """PyTorch's compiled-optimizer recipe: ``torch.compile`` of a function calling ``opt``."""
    return compiled(f"torch.compile({what})", lambda: opt(), bytes=bytes, access=RMW)


def _o2_step(make_ours):
    """A factory: numels -> mpnb's one-pass O2 step over fresh bf16 params of those sizes."""
    return lambda numels: _OursO2(_params(numels, torch.bfloat16), make_ours)


def _o2_case(name, work, numels, quick) -> Case:
    make_torch, make_ours, bpp = _O2[name]
    bpp += PREPASS
    n = sum(numels)
    nbytes = _step_bytes(name, bpp, numels)
    a, b = _params(numels, torch.bfloat16), _params(numels, torch.bfloat16)
    target = _TARGETS.get((name, work), 1.5)
    cands = [
        Candidate(
            f"torch O2 {name} (copy, unscale, step, copy)", _TorchO2(a, make_torch), nbytes, RMW
        ),
        Candidate(
            f"mpnb one-pass O2 {name}",
            _OursO2(b, make_ours),
            nbytes,
            RMW,
            target,
            0.85 if work == _A else None,
            in_cache=_in_cache(_o2_step(make_ours), bpp) if work == _A else None,
        ),
    ]
    if name in _COMPILED:
        o2 = _TorchO2(_params(numels, torch.bfloat16), _COMPILED[name])
        cands.append(_compiled_step(o2, nbytes, f"O2 {name}: copy, unscale, step, copy"))
    return Case(f"O2 {name} step", work, cands, bandwidth_numel=n)


def _fp32_case(name, work, numels) -> Case:
    """An fp32 step without master weights (bytes: :data:`_FP32`), against PyTorch's."""
    make_ours, bpp = _FP32[name]
    n = sum(numels)
    nbytes = _step_bytes(name, bpp, numels)
    theirs = _O2[name][0](_params(numels, torch.float32))
    ours = make_ours(_params(numels, torch.float32))
    bw = 0.7 if work == _A else None  # the memory-wall target holds for >= 64 MiB of params

    def fresh(ns):
        return make_ours(_params(ns, torch.float32)).step

    roofline = _in_cache(fresh, bpp) if work == _A else None
    cands = [
        Candidate(f"torch {name} (fp32)", theirs.step, nbytes, RMW),
        Candidate(
            f"mpnb Fused{name.split()[0]} fp32",
            ours.step,
            nbytes,
            RMW,
            None,
            bw,
            in_cache=roofline,
        ),
    ]
    return Case(f"fp32 {name} step", work, cands, bandwidth_numel=n)


def _adam_cases(work, numels, quick) -> Iterator[Case]:
    n = sum(numels)
    a, b, c = (_params(numels, torch.float32) for _ in range(3))
    ta = torch.optim.AdamW(a, lr=_LR, weight_decay=0.01, fused=True)
    ours = FusedAdam(b, lr=_LR, weight_decay=0.01)

    def adamw(ns):
        return FusedAdam(_params(ns, torch.float32), lr=_LR, weight_decay=0.01).step

    step = _COMPILED["AdamW"](_params(numels, torch.float32)).step
    yield Case(
        "fp32 AdamW step",
        work,
        [
            Candidate("torch AdamW(fused=True)", ta.step, 28 * n, RMW),
            Candidate(
                "mpnb FusedAdam",
                ours.step,
                28 * n,
                RMW,
                0.95,
                0.85 if work == _A else None,
                in_cache=_in_cache(adamw, 28) if work == _A else None,
            ),
            _compiled_step(step, 28 * n),
        ],
        bandwidth_numel=n,
    )
    tf = torch.optim.AdamW(c, lr=_LR, weight_decay=0.01, foreach=True)
    yield Case(
        "fp32 AdamW step vs foreach",
        work,
        [
            Candidate("torch AdamW(foreach=True)", tf.step, 28 * n, RMW),
            Candidate("mpnb FusedAdam", ours.step, 28 * n, RMW, 1.0),
            _compiled_step(step, 28 * n),
        ],
        bandwidth_numel=n,
    )
    d = _params(numels, torch.bfloat16)
    yield Case(
        "O2 AdamW vs fp32 fused AdamW alone",
        work,
        [
            Candidate("torch AdamW(fused=True) fp32", ta.step, 28 * n, RMW),
            Candidate("mpnb one-pass O2 AdamW", _OursO2(d, _O2["AdamW"][1]), 30 * n, RMW, 1 / 1.15),
            _compiled_step(step, 28 * n),
        ],
        bandwidth_numel=n,
    )
    e, f = _params(numels, torch.bfloat16), _params(numels, torch.bfloat16)
    yield Case(
        "O2 AdamW step, torch GradScaler",
        work,
        [
            Candidate(
                "torch copy + GradScaler.step(AdamW fused) + update + copy",
                _TorchO2(e, _O2["AdamW"][0], scaler=True),
                30 * n,
                RMW,
            ),
            Candidate("mpnb one-pass O2 AdamW", _OursO2(f, _O2["AdamW"][1]), 30 * n, RMW, 1.8),
            _compiled_step(
                _TorchO2(_params(numels, torch.bfloat16), _COMPILED["AdamW"], scaler=True),
                30 * n,
                "copy + GradScaler.step(AdamW) + update + copy",
            ),
        ],
        bandwidth_numel=n,
    )


def _pure_bf16_case(work, numels) -> Case:
    n = sum(numels)
    b = PURE_BF16_BYTES
    opts = {
        "round to nearest": {},
        "stochastic_rounding=True": dict(stochastic_rounding=True),
        "kahan_summation=True": dict(kahan_summation=True),
    }
    params = {k: _params(numels, torch.bfloat16, seed=1) for k in ("torch", "compiled", *opts)}
    ta = torch.optim.AdamW(params["torch"], lr=_LR, weight_decay=0.01, fused=True)

    def make(k, ps):
        return FusedAdam(ps, lr=_LR, weight_decay=0.01, generator=torch.Generator(), **opts[k])

    ours = {k: make(k, params[k]) for k in opts}

    def roofline(k, bpp):
        return _in_cache(lambda ns: make(k, _params(ns, torch.bfloat16, seed=1)).step, bpp)

    bw = PURE_BF16_BW_TARGET
    return Case(
        "pure-bf16 AdamW step",
        work,
        [
            Candidate("torch AdamW(fused=True), bf16 params and moments", ta.step, b["torch"] * n),
            Candidate(
                "mpnb FusedAdam bf16, round to nearest",
                ours["round to nearest"].step,
                b["nearest"] * n,
                RMW,
                None,
                bw,
                in_cache=roofline("round to nearest", b["nearest"]),
            ),
            Candidate(
                "mpnb FusedAdam(stochastic_rounding=True)",
                ours["stochastic_rounding=True"].step,
                b["stochastic"] * n,
                RMW,
                None,
                bw,
                in_cache=roofline("stochastic_rounding=True", b["stochastic"]),
            ),
            Candidate(
                "mpnb FusedAdam(kahan_summation=True)",
                ours["kahan_summation=True"].step,
                b["kahan"] * n,
                RMW,
                None,
                bw,
                in_cache=roofline("kahan_summation=True", b["kahan"]),
            ),
            _compiled_step(_COMPILED["AdamW"](params["compiled"]).step, b["torch"] * n),
        ],
        bandwidth_numel=n,
    )


def cases(opts: Options) -> Iterator[Case]:
    """Yield the cases workload by workload (one workload's tensors alive at a time)."""
    for work, make in WORKLOADS.items():
        numels = [max(1, round(k * opts.scale)) for k in make()]
        yield from _adam_cases(work, numels, opts.quick)
        for name in _O2:
            yield _o2_case(name, work, numels, opts.quick)
            if name in _FP32:
                yield _fp32_case(name, work, numels)
        yield _pure_bf16_case(work, numels)
