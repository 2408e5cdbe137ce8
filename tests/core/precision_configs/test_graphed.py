"""An opt level with its whole step captured in a CUDA graph (``O2+graph``): refused off CUDA,
fused optimizers only, and on a GPU the same weights as the eager step, with overflowing steps
still skipped on the device."""

import pytest
import torch

from mpnb.core.precision_configs import PRECISION_CONFIGS, GraphedAmpConfig, get_config
from mpnb.core.precision_configs._graphed import WARMUP_STEPS, _copy_into
from mpnb.optimizers import FusedAdam, FusedSGD


def test_each_level_has_a_captured_twin_that_says_it_needs_cuda():
    for level in ("O0", "O1", "O2", "O3"):
        cfg = get_config(f"{level}+graph")
        assert isinstance(cfg, GraphedAmpConfig) and cfg.opt_level == level
        assert cfg.halves(("bf16",)) == get_config(level).halves(("bf16",))
        assert cfg.label("bf16").endswith(" graph") and not cfg.runs_by_default("cuda")
        assert "needs a CUDA GPU" in cfg.unavailable("cpu") and cfg.unavailable("cuda") == ""


def test_it_trains_with_a_fused_optimizer_whatever_was_asked():
    cfg = PRECISION_CONFIGS["O2+graph"]
    params = torch.nn.Linear(4, 4).parameters()
    adam = cfg.make_optimizer("adam", params, 1e-3)
    assert type(adam) is FusedAdam and adam.capturable  # lr on the device: a schedule reaches it
    assert isinstance(adam.param_groups[0]["lr"], torch.Tensor)
    assert type(cfg.make_optimizer("sgd", torch.nn.Linear(4, 4).parameters(), 1e-3)) is FusedSGD
    assert "fused_adam" in cfg.optimizer_note("adam")
    assert (
        "capturable" in cfg.optimizer_note("fused_adam") and cfg.optimizer_note("fused_sgd") == ""
    )
    assert "capturable=True" in cfg.snippet("bf16", optimizer="adam")


def test_a_batch_of_another_shape_is_refused_with_the_fix():
    static = (torch.zeros(4, 3), {"mask": torch.zeros(4)})
    _copy_into(static, (torch.ones(4, 3), {"mask": torch.ones(4)}))
    assert static[0].sum() == 12 and static[1]["mask"].sum() == 4
    with pytest.raises(ValueError, match="drop_last=True"):
        _copy_into(static, (torch.ones(5, 3), {"mask": torch.ones(5)}))


def test_a_cpu_compare_shows_it_as_unsupported():
    import mpnb.lab

    df = mpnb.lab.compare("mlp", configs=("O0", "O2+graph"), steps=4, progress=False)
    row = df[df.opt_level == "O2+graph"].iloc[0]
    assert row.status == "unsupported" and "CUDA GPU" in row.error


def _train(name, steps, poison=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))
    model = model.cuda()
    cfg = get_config(name)
    opt = cfg.make_optimizer("fused_adam", model.parameters(), 1e-2)
    step = cfg.train_step(model, opt, half_dtype=torch.float16)
    g = torch.Generator(device="cuda").manual_seed(1)
    for i in range(steps):
        x = torch.randn(32, 64, device="cuda", generator=g).half()
        y = torch.randint(0, 8, (32,), device="cuda", generator=g)
        if poison is not None and i == poison:  # in the data: a replay sees what it is fed
            x[0, 0] = float("inf")

        def loss(m, x, y):
            return torch.nn.functional.cross_entropy(m(x).float(), y)

        step.run(x, y, loss)
    torch.cuda.synchronize()
    out = [p.detach().clone() for p in step.module.parameters()], step.scale.clone()
    step.close()
    return out


@pytest.mark.gpu
def test_replays_train_bitwise_as_the_eager_step():
    eager, s_eager = _train("O2", WARMUP_STEPS + 6)
    graphed, s_graph = _train("O2+graph", WARMUP_STEPS + 6)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))
    assert torch.equal(s_eager, s_graph)


@pytest.mark.gpu
def test_an_overflow_inside_the_replays_is_skipped_on_the_device():
    k = WARMUP_STEPS + 3  # an inf input at a replayed step: the scale backs off, nothing written
    eager, s_eager = _train("O2", WARMUP_STEPS + 6, k)
    graphed, s_graph = _train("O2+graph", WARMUP_STEPS + 6, k)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))
    assert torch.equal(s_eager, s_graph) and s_graph.item() < 2.0**16
