"""amp's per-step cost is structural: a fixed number of kernel and Python calls per step.

No timings here (benchmarks report those): each test runs the same training step on models
of 10 and 80 params and asserts that amp adds the same work to both, so a regression to a
loop over the params (one kernel launch, one Python call or one host read per tensor) fails.
"""

import sys
import warnings
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mpnb import amp
from mpnb.core.amp import EmulatedHalfWarning
from mpnb.core.ops import ensure_kernels

pytestmark = pytest.mark.skipif(not ensure_kernels(), reason="needs the compiled CPU kernels")

_AMP_DIR = "mpnb/core/amp/"


class _Ops(TorchDispatchMode):
    """Counts every operator that reaches the dispatcher (aten and torch.ops.mpnb)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket).split(".")[-1]] += 1
        return func(*args, **(kwargs or {}))


def _setup(level, layers, opt_cls=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers // 2)])
    make = opt_cls or (lambda p: torch.optim.SGD(p, lr=1e-3, foreach=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedHalfWarning)
        model, opt = amp.initialize(
            model,
            make(model.parameters()),
            opt_level=level,
            half_dtype=torch.bfloat16,
            loss_scale="dynamic" if level in ("O1", "O2") else None,
            verbosity=0,
        )
    params = list(model.parameters())
    grads = [torch.full_like(p, 2.0) for p in params]
    loss = torch.ones(())

    def step():
        opt.zero_grad()
        with amp.scale_loss(loss, opt):
            for p, g in zip(params, grads, strict=True):
                p.grad = g  # what a backward leaves
        opt.step()

    step()  # first step: lazy optimizer state
    return step, opt._amp_stash.amp_state


def _amp_ops(level, layers, opt_cls=None) -> Counter:
    step, _ = _setup(level, layers, opt_cls)
    with _Ops() as mode:
        step()
    return mode.ops


def _amp_calls(level, layers) -> Counter:
    """Python and C calls made from amp's own code in one step (sys.setprofile)."""
    step, _ = _setup(level, layers)
    calls = Counter()

    def prof(frame, event, arg):
        if event in ("call", "c_call") and _AMP_DIR in frame.f_code.co_filename.replace("\\", "/"):
            name = getattr(arg, "__name__", None) if event == "c_call" else frame.f_code.co_name
            calls[(event, name)] += 1

    sys.setprofile(prof)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_kernel_calls_per_step_do_not_grow_with_the_params(level):
    small, big = _amp_ops(level, 10), _amp_ops(level, 80)
    if level == "O2":  # one fresh fp32 master grad per param (Apex frees them in zero_grad)
        for ops in (small, big):
            ops.pop("empty_like", None)
            ops.pop("empty", None)
    assert small == big
    # amp's kernels of a step (SGD's own foreach op and record_function markers aside): the
    # block's new overflow flag, scale the loss, one unscale (O2: grads into masters), the
    # scale update (rule, clamp and inverse in one op), the flag read once on the host (SGD's
    # Python loop cannot skip on the device), the step counted on the device (skipped, and
    # the run of skips at the floor), and under O2 one master -> model copy.
    amp_ops = {k: v for k, v in big.items() if not k.startswith(("_record_function", "_foreach"))}
    counted = {"gt": 1, "le": 1, "logical_and_": 1, "slice": 2, "add_": 2, "mul_": 1}
    assert amp_ops == {
        "zeros": 1,
        "mul": 1,
        "multi_tensor_scale": 2 if level == "O2" else 1,
        "update_loss_scale_": 1,
        "_local_scalar_dense": 1,
        "view": 2,
        "detach": 1,
        **counted,
    }


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_python_calls_per_step_do_not_grow_with_the_params(level):
    small, big = _amp_calls(level, 10), _amp_calls(level, 80)
    if level == "O2":
        assert big.pop(("c_call", "empty_like")) == 80 and small.pop(("c_call", "empty_like")) == 10
    assert small == big
    # amp's whole step, independent of the model (about 20 of the calls count the step on the
    # device and look at the counts: the static-scale warning and the collapse error)
    assert sum(big.values()) < 90


def test_one_host_read_per_step_and_none_in_the_block():
    step, state = _setup("O1", 20)
    before = state.host_syncs
    for _ in range(3):
        step()
    assert state.host_syncs - before == 3


def test_fused_optimizer_step_is_constant_too():
    optimizers = pytest.importorskip("mpnb.optimizers")

    def fused(p):
        return optimizers.FusedAdam(p, lr=1e-3)

    small, big = _amp_ops("O2", 10, fused), _amp_ops("O2", 80, fused)
    assert small == big
    assert big["update_loss_scale_"] == 1 and big["_local_scalar_dense"] == 0


def test_param_groups_added_after_initialize_get_masters():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    model = torch.nn.Sequential(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedHalfWarning)
        model, opt = amp.initialize(
            model,
            opt,
            opt_level="O2",
            half_dtype=torch.bfloat16,
            loss_scale="dynamic",
            verbosity=0,
        )
    opt.add_param_group({"params": list(b.parameters())})
    before = b.weight.detach().clone()
    loss = model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    masters = opt.param_groups[1]["params"]
    assert all(m.dtype == torch.float32 and m.grad is not None for m in masters)
    assert b.weight.grad is None  # consumed into the fp32 master grad
    opt.step()
    assert not torch.equal(before, b.weight)
    assert torch.equal(b.weight, masters[0].detach().to(torch.bfloat16))


def test_overflow_flag_survives_a_later_block_of_the_same_scaler():
    # Each block has its own overflow flag: a later block of the same scaler (another
    # optimizer's) must not clear the flag the first optimizer reads at its step.
    torch.manual_seed(0)
    ma, mb = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    oa, ob = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ma, mb))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedHalfWarning)
        (ma, mb), (oa, ob) = amp.initialize(
            [ma, mb],
            [oa, ob],
            opt_level="O1",
            half_dtype=torch.bfloat16,
            loss_scale="dynamic",
            verbosity=0,
        )
    loss = torch.ones(())
    for model, bad in ((ma, True), (mb, False)):
        with amp.scale_loss(loss, oa if model is ma else ob):
            for p in model.parameters():
                p.grad = torch.full_like(p, float("inf") if bad else 1.0)
    a0, b0 = ma.weight.detach().clone(), mb.weight.detach().clone()
    oa.step()
    ob.step()
    assert torch.equal(ma.weight, a0)  # overflowed: skipped
    assert not torch.equal(mb.weight, b0)
