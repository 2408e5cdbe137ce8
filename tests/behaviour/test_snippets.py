"""Every configuration's snippet (the lines a user writes to train that way in their own loop)
runs as written for one training step, and every row, the report and the widget carry it."""

import contextlib
import copy

import pytest
import torch

from mpnb.core.precision_configs import (
    DEFAULT_OPTIMIZER,
    OPTIMIZERS,
    PRECISION_CONFIGS,
    config_names,
    get_config,
    make_optimizer,
    tf32_enabled,
)
from mpnb.core.precision_configs._optimizers import optimizer_code

RUNS = [
    (name, half)
    for name in config_names()
    for half in get_config(name).halves(("bf16", "fp16"))
    # one compile is enough (tens of seconds on a CPU): the fp16 one differs only in its scaler
    if not (name == "torch-amp+compile" and half == "fp16")
    # a captured step needs CUDA: test_graph_snippets_train_on_cuda
    and not get_config(name).name.endswith("+graph")
]
GRAPHED = [n for n in config_names() if n.endswith("+graph")]


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _run(code: str, flags: bool) -> dict:
    torch.manual_seed(0)
    model = _Net()
    x, y = torch.randn(12, 8), torch.randint(0, 3, (12,))
    ns = dict(
        model=model,
        batches=[(x, y)],  # one step
        loss_fn=torch.nn.functional.cross_entropy,
        before=copy.deepcopy(model.state_dict()),
    )
    with tf32_enabled() if flags else contextlib.nullcontext():  # tf32's set global flags:
        exec(compile(code, "<snippet>", "exec"), ns)  # noqa: S102  # put them back after
    return ns


@pytest.mark.parametrize("name, half", RUNS)
def test_every_snippet_trains_one_step_as_written(name, half):
    code = PRECISION_CONFIGS[name].snippet(half, "cpu", "adam", 1e-2)
    assert code.startswith("# model: your fp32 model on cpu")
    assert "for x, y in batches:" in code and code.count("\n") < 20  # a few lines
    ns = _run(code, flags=get_config(name).peer)  # a peer may set global flags (tf32 does)
    assert torch.isfinite(ns["loss"]), ns["loss"]
    model = getattr(ns["model"], "_orig_mod", ns["model"])  # torch.compile's wrapper: its model
    after = model.state_dict()
    # compared in the dtype the weights have now (O2/O3 keep a half copy of them)
    same = [torch.equal(v.to(after[k].dtype), after[k]) for k, v in ns["before"].items()]
    assert not all(same), "the weights did not change"


@pytest.mark.gpu
@pytest.mark.parametrize("name", GRAPHED)
def test_graph_snippets_train_on_cuda(name):
    half = get_config(name).halves(("bf16",))[0]
    code = PRECISION_CONFIGS[name].snippet(half, "cuda", "adam", 1e-2)
    torch.manual_seed(0)
    model = _Net().cuda()
    x, y = torch.randn(12, 8, device="cuda"), torch.randint(0, 3, (12,), device="cuda")
    before = copy.deepcopy(model.state_dict())
    ns = dict(model=model, batches=[(x, y)] * 6, loss_fn=torch.nn.functional.cross_entropy)
    exec(compile(code, "<snippet>", "exec"), ns)  # noqa: S102
    after = ns["model"].state_dict()
    assert not all(torch.equal(v.to(after[k].dtype), after[k]) for k, v in before.items())


def test_the_snippets_say_what_each_configuration_does():
    by = {n: get_config(n) for n in config_names()}
    o2 = by["O2"].snippet("bf16", "cuda", "fused_adam", 1e-3)
    assert 'opt_level="O2", half_dtype=torch.bfloat16' in o2 and "amp.scale_loss" in o2
    assert "from mpnb.optimizers import FusedAdam" in o2
    fp16 = by["torch-amp"].snippet("fp16", "cuda:0", "adamw", 1e-3)
    assert 'torch.autocast("cuda", dtype=torch.float16)' in fp16
    assert 'torch.amp.GradScaler("cuda")' in fp16 and "weight_decay=0.01, fused=True" in fp16
    assert "GradScaler" not in by["torch-amp"].snippet("bf16", "cpu")  # bf16 needs no scaling
    assert 'convert_to_float8_training(model, "delayed")' in by["fp8-delayed"].snippet("fp8")
    assert "stochastic_rounding=True" in by["bf16-pure+sr"].snippet("bf16")
    assert 'fp32_precision = "tf32"' in by["tf32"].snippet("tf32", "cuda")
    graph = by["O2+graph"].snippet("bf16", "cuda", "adam")
    assert "FusedAdam(" in graph and "torch.cuda.graph(graph)" in graph  # capturable: fused
    assert "graph.replay()" in graph and 'opt_level="O2"' in graph


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("option", [None, "stochastic_rounding"])
def test_the_optimizer_line_builds_what_the_lab_builds(name, option):
    import mpnb.optimizers

    p = torch.nn.Parameter(torch.zeros(4))
    imp, line = optimizer_code(name, 0.05, option)
    ns = {"torch": torch, "model": torch.nn.ParameterList([p]), **vars(mpnb.optimizers)}
    exec(line, ns)  # noqa: S102
    want = make_optimizer(name, [p], 0.05, option)
    assert type(ns["optimizer"]) is type(want) and ns["optimizer"].defaults == want.defaults
    assert (imp == "") is type(want).__module__.startswith("torch.optim")


@pytest.fixture(scope="module")
def df():
    import mpnb.lab

    return mpnb.lab.compare("mlp", configs=("O0", "O2", "torch-amp"), steps=4, progress=False)


def test_rows_the_report_and_the_widget_carry_the_snippets(df, tmp_path):
    import mpnb.lab
    from mpnb.lab import workloads

    rows = df.set_index("opt_level")
    lr = workloads.get("mlp", "auto", "cpu").lr  # the row's: the workload's own
    want = get_config("O2").snippet("bf16", "cpu", DEFAULT_OPTIMIZER, lr)  # the default's
    assert rows.loc["O2", "snippet"] == want and "FusedAdam(" in want
    assert "torch.autocast" in rows.loc["torch-amp", "snippet"]
    page = mpnb.lab.report(df, tmp_path / "r.html").read_text()
    assert "<section id='snippets'>" in page and page.count("<pre><code>") == 3
    assert "amp.scale_loss(loss, optimizer)" in page and "torch.autocast(&quot;cpu&quot;" in page
