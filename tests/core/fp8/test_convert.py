"""The module swap: shared parameters, filters, the inverse, state_dict, bitwise resume."""

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from mpnb import fp8
from tests.core.fp8.test_linear import _delayed_model


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU())
        self.attn = torch.nn.MultiheadAttention(32, 2, batch_first=True)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        h = self.body(x).unsqueeze(1)
        return self.head(self.attn(h, h, h)[0].squeeze(1))


def test_swap_shares_parameters_and_keeps_the_optimizer_working():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built BEFORE the swap
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    fp8.convert_to_float8_training(model, "tensorwise")
    assert set(fp8.float8_layers(model)) == {"body.0", "head"}  # not attn.out_proj
    assert model.head.fqn == "head" and model.body[0].fqn == "body.0"
    assert all(p is params[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    before = model.head.weight.detach().clone()
    model(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
    assert not torch.equal(model.head.weight, before)


def test_filter_shared_modules_root_linear_and_inverse():
    shared = torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared, torch.nn.Linear(8, 2))
    fp8.convert_to_float8_training(model, "rowwise", module_filter_fn=lambda m, fqn: fqn != "3")
    assert type(model[0]) is fp8.Float8Linear and model[0] is model[2]
    assert type(model[3]) is torch.nn.Linear
    fp8.convert_from_float8_training(model)
    assert type(model[0]) is torch.nn.Linear and model[0] is model[2]
    assert model[0].weight is shared.weight
    root = fp8.convert_to_float8_training(torch.nn.Linear(4, 4), "mxfp8")
    assert isinstance(root, fp8.Float8Linear) and root.fqn == "(root)"


def test_delayed_state_dict_round_trip_and_plain_checkpoints():
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    plain_sd = {k: v.clone() for k, v in plain.state_dict().items()}
    model = fp8.convert_to_float8_training(plain, fp8.DelayedScaling(amax_history_len=4))
    for _ in range(3):
        model(torch.randn(8, 16)).sum().backward()
    sd = model.state_dict()
    assert sd["0.fp8_amax_history"].shape == (4, 3) and sd["0.fp8_scale"].shape == (3,)
    assert (sd["0.fp8_amax_history"][:3] > 0).all()

    other = fp8.convert_to_float8_training(
        torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)),
        fp8.DelayedScaling(amax_history_len=4),
    )
    other.load_state_dict(sd)
    for k, v in sd.items():
        assert torch.equal(other.state_dict()[k], v), k
    # a checkpoint of the never-converted model loads strictly: the FP8 state starts fresh
    result = other.load_state_dict(plain_sd)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(other[0].fp8_scale, torch.ones(3))
    assert torch.equal(other[0].fp8_amax_history, torch.zeros(4, 3))
    # the inverse gives a model whose state_dict loads into a plain one
    torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)).load_state_dict(
        fp8.convert_from_float8_training(other).state_dict()
    )


RESUME = textwrap.dedent("""
    import sys, warnings
    import torch
    from mpnb import fp8
    warnings.simplefilter("ignore")
    mode, path, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
    RECIPES = [fp8.DelayedScaling(amax_history_len=3), fp8.DelayedScaling(),
               fp8.TensorwiseScaling(), fp8.RowwiseScaling(), fp8.MXFP8BlockScaling()]

    def build(rec):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 8))
        m = fp8.convert_to_float8_training(m, rec)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    def train(m, opt, steps):
        for i in steps:
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(16, 24, generator=g) * (1 + i), torch.randn(16, 8, generator=g)
            opt.zero_grad()
            (m(x) - y).pow(2).mean().backward()
            opt.step()

    out = {}
    for j, rec in enumerate(RECIPES):
        m, opt = build(rec)
        if mode == "first":
            train(m, opt, range(2 * k))  # the uninterrupted run
            out[j] = {"full": m.state_dict(), "opt": opt.state_dict()["state"]}
            m, opt = build(rec)
            train(m, opt, range(k))
            out[j]["ckpt"] = {"model": m.state_dict(), "opt": opt.state_dict()}
        else:
            ck = torch.load(path + ".first", weights_only=False)[j]["ckpt"]
            m.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            train(m, opt, range(k, 2 * k))
            out[j] = {"full": m.state_dict(), "opt": opt.state_dict()["state"]}
    torch.save(out, path + "." + mode)
""")


@pytest.mark.slow
def test_resume_in_a_fresh_process_is_bitwise(tmp_path):
    """k steps, save, load in a NEW python process, k more == 2k uninterrupted, bit for bit."""
    script, path = tmp_path / "train.py", str(tmp_path / "run")
    script.write_text(RESUME)
    for mode in ("first", "resume"):
        r = subprocess.run(
            [sys.executable, str(script), mode, path, "5"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-3000:]
    first = torch.load(path + ".first", weights_only=False)
    resumed = torch.load(path + ".resume", weights_only=False)
    for j in first:
        full, res = first[j]["full"], resumed[j]["full"]
        assert list(full) == list(res)
        for key in full:
            assert torch.equal(full[key], res[key]), (j, key)
        for p in first[j]["opt"]:
            for name, v in first[j]["opt"][p].items():
                assert torch.equal(v, resumed[j]["opt"][p][name]), (j, p, name)
    # the short history rolled over: 10 steps recorded, only the last 3 kept
    assert (first[0]["full"]["0.fp8_amax_history"] > 0).all()


@pytest.mark.parametrize("name", list(fp8.RECIPES))
def test_resume_from_a_state_dict_is_bitwise(name):
    """In-process twin of the fresh-process test (fast): 4 steps, save, rebuild, 4 more."""
    rec = fp8.recipe(name, amax_history_len=3) if name == "delayed" else fp8.recipe(name)

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        m = fp8.convert_to_float8_training(m, rec)
        return m, torch.optim.Adam(m.parameters(), lr=1e-2)

    def train(m, opt, steps):
        for i in steps:
            g = torch.Generator().manual_seed(i)
            x = torch.randn(16, 24, generator=g) * (1 + i)
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.Float8FallbackWarning)
        full, opt = build()
        train(full, opt, range(8))
        half, opt = build()
        train(half, opt, range(4))
        ckpt = {"m": half.state_dict(), "o": opt.state_dict()}
        resumed, opt = build()
        resumed.load_state_dict(ckpt["m"])
        opt.load_state_dict(ckpt["o"])
        train(resumed, opt, range(4, 8))
    for key, v in full.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[key]), key


def test_a_delayed_layer_forgets_its_history_when_not_saved():
    """Control: without loading the amax history, the resumed run differs (the test can fail)."""
    torch.manual_seed(0)
    a = fp8.Float8Linear(8, 8, recipe="delayed")
    b = fp8.Float8Linear(8, 8, recipe="delayed")
    b.load_state_dict({"weight": a.weight.detach(), "bias": a.bias.detach()})
    x = torch.randn(4, 8) * 50
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a(x)
    assert not torch.equal(a(x), b(x))  # a quantizes with x's scale, b still with 1.0


@pytest.mark.parametrize("name", list(fp8.RECIPES))
def test_deepcopy_keeps_recipe_and_state(name):
    import copy

    layer = fp8.Float8Linear(8, 8, recipe=name, fqn="x")
    clone = copy.deepcopy(layer)
    assert clone.recipe == layer.recipe and clone.fqn == "x"
    assert clone.state_dict().keys() == layer.state_dict().keys()


# ---- a model with no layer to convert ----


def _no_fp8_warnings(rec):
    from mpnb.core.fp8.convert import NoFloat8LayerWarning

    return [str(r.message) for r in rec if issubclass(r.category, NoFloat8LayerWarning)]


class _Subclassed(torch.nn.Linear):
    pass


def _convs():
    return torch.nn.Sequential(torch.nn.Conv1d(1, 2, 3), torch.nn.ReLU())


def _one_linear():
    return torch.nn.Sequential(torch.nn.Linear(4, 4))


def _subclassed():
    return torch.nn.Sequential(_Subclassed(4, 4))


def _refuse_all(module, fqn):
    return False


@pytest.mark.parametrize(
    "make,keep,why",
    [
        (_convs, None, "no nn.Linear"),
        (_one_linear, _refuse_all, "module_filter_fn"),
        (_subclassed, None, "subclass"),
    ],
)
def test_converting_no_layer_warns_with_the_reason(make, keep, why):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fp8.convert_to_float8_training(make(), "tensorwise", module_filter_fn=keep)
    msgs = _no_fp8_warnings(rec)
    assert len(msgs) == 1 and "no layer ran in FP8" in msgs[0] and why in msgs[0]


def test_converting_some_layer_or_an_already_converted_model_does_not_warn():
    model = Net()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fp8.convert_to_float8_training(model, "tensorwise")
        fp8.convert_to_float8_training(model, "tensorwise")  # kept as they are: still FP8
    assert not _no_fp8_warnings(rec)


def test_the_lab_row_of_a_model_without_linear_says_no_layer_ran_in_fp8():
    import mpnb.lab

    def conv():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv1d(1, 2, 3, padding=1), torch.nn.Flatten())

    x, y = torch.randn(16, 1, 4), torch.randn(16, 8)
    df = mpnb.lab.compare(
        conv,
        (x, y),
        loss_fn=lambda o, t: (o - t).pow(2).mean(),
        configs=["O0", "fp8-tensorwise"],
        batch_sizes=(16,),
        steps=2,
        progress=False,
        threads=1,
    )
    fp8_row = df[df.opt_level == "fp8-tensorwise"].iloc[0]
    assert "no layer ran in FP8" in fp8_row.warnings
    assert "no layer ran in FP8" not in df[df.opt_level == "O0"].iloc[0].warnings


@pytest.mark.parametrize("second", ["tensorwise", "rowwise", "mxfp8"])
def test_converting_a_converted_model_takes_the_new_recipe(second):
    model = _delayed_model()
    params = list(model.parameters())
    out = fp8.convert_to_float8_training(model, second)
    assert out is model
    assert [layer.recipe.name for layer in fp8.float8_layers(model).values()] == [second] * 2
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert "0.fp8_scale" not in model.state_dict()  # the delayed recipe's state is gone
    same = fp8.convert_to_float8_training(model, second)
    assert all(isinstance(m, fp8.Float8Linear) for m in (same[0], same[2]))


def test_converting_again_with_the_same_recipe_keeps_the_state():
    model = _delayed_model()
    history = model[0].fp8_amax_history.clone()
    layer = model[0]
    fp8.convert_to_float8_training(model, "delayed")
    assert model[0] is layer and torch.equal(model[0].fp8_amax_history, history)
