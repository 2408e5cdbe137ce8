"""Keep-lists: which linear layers a recipe leaves in the model's precision, found by name,
pattern, block and head on a generic model; kept layers compute bitwise as before; a bad
pattern, too many blocks or a bad spec is refused before anything changes."""

import copy
import warnings

import pytest
import torch
from torch import nn

from mpnb import fp8
from mpnb.core.fp8.keep import KeepList, find_blocks, linear_layers


class Block(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.ff(x)


class Net(nn.Module):
    """An input layer, 3 blocks of 3 linear layers, a longer list of 5 single-linear taps
    (fewer linear layers in all: not the blocks), and a head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.taps = nn.ModuleList(nn.Linear(8, 8) for _ in range(5))
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        h = self.embed(x)
        for b in self.layers:
            h = b(h)
        return self.out(h + sum(t(h) for t in self.taps))


def _net():
    torch.manual_seed(0)
    return Net()


def _block(i):
    return [f"layers.{i}.attn", f"layers.{i}.ff.0", f"layers.{i}.ff.2"]


def test_the_blocks_are_the_list_holding_the_most_linear_layers():
    model = _net()
    assert find_blocks(model) == ("layers", ["layers.0", "layers.1", "layers.2"])
    assert find_blocks(model, "taps") == ("taps", [f"taps.{i}" for i in range(5)])
    assert len(linear_layers(model)) == 1 + 9 + 5 + 1
    # a Sequential of different layers is no block list: the rules that count blocks find none
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert find_blocks(plain) is None
    assert KeepList(last_share=0.15, head=True).kept(plain) == []
    with pytest.raises(ValueError, match="blocks='ff'") as e:
        find_blocks(model, "ff")
    assert "'layers'" in str(e.value) and "'taps'" in str(e.value)  # the lists it could be


@pytest.mark.parametrize(
    "spec, want",
    [
        ("keep=out", ["out"]),
        ("keep=layers.1", _block(1)),  # a module: every linear layer under it
        ("keep=layers.*.ff.*", [f for i in range(3) for f in _block(i)[1:]]),
        ("keep=embed+out", ["embed", "out"]),
        ("keep-first=1", _block(0)),
        ("keep-last=2", _block(1) + _block(2)),
        ("keep-first=1:keep-last=1", _block(0) + _block(2)),
        ("keep-last=3", _block(0) + _block(1) + _block(2)),
        ("keep-last=15%", _block(2)),  # ceil(0.15 * 3) = 1
        ("keep-last=34%", _block(1) + _block(2)),
        ("keep-head", [f"taps.{i}" for i in range(5)] + ["out"]),  # all after the blocks
        ("keep-last=1:blocks=taps", ["taps.4"]),
        ("keep-none", []),
    ],
)
def test_names_patterns_and_blocks_select_these_layers(spec, want):
    keep = KeepList.parse(spec)
    assert keep.kept(_net()) == want  # in model order
    assert KeepList.parse(keep.spec()) == keep and bool(keep) == bool(want)


def test_a_share_of_the_blocks_is_rounded_up_exactly():
    many = nn.Sequential(*(nn.Linear(4, 4) for _ in range(20)))
    assert KeepList(last_share=0.15).kept(many) == ["17", "18", "19"]  # 0.15 * 20 = 3, not 4
    assert KeepList(last_share=0.16).kept(many) == ["16", "17", "18", "19"]


def test_kept_layers_stay_linear_and_compute_bitwise_as_the_fp32_model():
    model, ref = _net(), _net()
    x = torch.randn(6, 4)
    fp8.convert_to_float8_training(model, "nvfp4", keep="keep-last=1:keep=embed")
    layers = fp8.float8_layers(model)
    kept = ["embed", *_block(2)]
    assert all(type(model.get_submodule(f)) is nn.Linear for f in kept)
    assert set(layers) == set(linear_layers(model)) - set(kept)
    for fqn in kept:  # the same weights, the same bits
        a, b = model.get_submodule(fqn), ref.get_submodule(fqn)
        h = torch.randn(5, a.in_features)
        assert a.weight is not b.weight and torch.equal(a(h), b(h))
    # everything kept: the whole model, forward and backward, bitwise the fp32 one
    whole = _net()
    with pytest.warns(fp8.NoFloat8LayerWarning, match="keep-list kept all 16"):
        fp8.convert_to_float8_training(whole, "mxfp4", keep=["*"])
    y, y_ref = whole(x), ref(x)
    y.sum().backward(), y_ref.sum().backward()
    assert torch.equal(y, y_ref)
    grads = zip(whole.parameters(), ref.parameters(), strict=True)
    assert all(torch.equal(p.grad, q.grad) for p, q in grads)


def test_a_layer_converted_before_becomes_plain_again_with_its_parameters():
    model = _net()
    fp8.convert_to_float8_training(model, "tensorwise")
    weight = model.out.weight
    fp8.convert_to_float8_training(model, "mxfp8", keep="keep=out")
    assert type(model.out) is nn.Linear and model.out.weight is weight
    assert fp8.float8_layers(model)["embed"].recipe.name == "mxfp8"


def test_the_description_names_whole_blocks_and_the_share():
    model = _net()
    text = KeepList.parse("keep-last=1:keep=embed").describe(model)
    assert text == "kept in fp32: embed, layers.2 (4 of 16 linear layers, 25%)"
    many = KeepList.parse("keep=embed+layers.*.ff.*").describe(model)
    assert many == (
        "kept in fp32: embed, layers.0.ff.0, layers.0.ff.2, layers.1.ff.0, layers.1.ff.2, "
        "layers.2.ff.0 and 1 more (7 of 16 linear layers, 44%)"
    )
    assert (
        KeepList().describe(model) == "kept in the model's precision: none (0 of 16 linear layers)"
    )
    assert KeepList.parse("keep-head").share(model) == 6 / 16
    model.half()
    assert KeepList.parse("keep=out").describe(model).startswith("kept in fp16: out")


@pytest.mark.parametrize(
    "keep, match",
    [
        (
            "keep=lm_head",
            r"keep='lm_head' matches no nn.Linear layer of Net; its linear layers are embed, "
            r"layers.0.attn, .*: give one of these names",
        ),
        ("keep-last=4", r"keep-last=4: Net has 3 blocks \(layers.0 .. layers.2\); keep at most 3"),
        ("keep-first=9", r"keep-first=9: Net has 3 blocks"),
        ("keep-last=1:blocks=embed", r"blocks='embed' is not an nn.ModuleList"),
    ],
)
def test_a_keep_list_that_cannot_apply_is_refused_before_the_swap(keep, match):
    model = _net()
    with pytest.raises(ValueError, match=match):
        fp8.convert_to_float8_training(model, "nvfp4", keep=keep)
    assert not fp8.float8_layers(model)  # nothing changed


def test_counting_blocks_on_a_model_without_them_names_the_fix():
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    want = r"keep-last=1: Sequential has no list of repeated blocks .*keep=PATTERN.*blocks=FQN"
    with pytest.raises(ValueError, match=want):
        KeepList(last=1).kept(plain)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("", "is empty"),
        ("keep-first=1,keep-last=1", "join the options with ':', not ','"),
        ("keep-lats=1", r"'keep-lats=1' is not an option; expected options keep=PATTERN"),
        (
            "keep-last=x",
            r"keep-last='x' is not a number of blocks; give a count \(0 or more\) or a share",
        ),
        ("keep-first=-1", "keep-first='-1' is not a number of blocks"),
        ("keep-first=10%", "keep-first='10%' is not a number"),
        ("keep-last=0%", "keep-last='0%' is not a number"),
        ("keep-last=150%", "keep-last='150%' is not a number"),
        ("keep=", "'keep=' is not an option"),
        ("keep-head=yes", "'keep-head=yes' is not an option"),
        ("keep-last=1:keep-last=2", "gives keep-last twice; give it once"),
        ("keep-none:keep-head", "keep-none keeps nothing; give it alone"),
        ("keep-last=1:keep-last=50%", "gives keep-last twice"),
    ],
)
def test_bad_specs_are_refused_naming_the_form(spec, match):
    with pytest.raises(ValueError, match=match):
        KeepList.parse(spec)


def test_bad_fields_are_refused():
    with pytest.raises(ValueError, match="without ':', '\\+' or ','"):
        KeepList(names=("a:b",))
    with pytest.raises(ValueError, match="both count"):
        KeepList(last=1, last_share=0.5)
    with pytest.raises(ValueError, match="keep-first=True"):
        KeepList(first=True)
    with pytest.raises(ValueError, match="last_share=1.5"):
        KeepList(last_share=1.5)
    with pytest.raises(TypeError, match="expected a KeepList"):
        KeepList.of(3)
    assert KeepList.of({"last": 2}) == KeepList(last=2) and KeepList.of(None) == KeepList()
    assert KeepList.of("keep=out") == KeepList(names=("out",)) == KeepList(names="out")


def test_without_a_keep_list_the_swap_is_unchanged():
    model = _net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no note of any kind
        fp8.convert_to_float8_training(model, "nvfp4")
    assert set(fp8.float8_layers(model)) == set(linear_layers(_net()))
    other = copy.deepcopy(_net())
    fp8.convert_to_float8_training(other, "nvfp4", keep=KeepList())
    assert set(fp8.float8_layers(other)) == set(fp8.float8_layers(model))


def test_a_converted_model_has_the_same_blocks_and_kept_layers():
    flat = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    keep = KeepList(last=2)
    fp8.convert_to_float8_training(flat, "tensorwise", keep=keep)  # 0, 1 Float8Linear; 2, 3 not
    assert find_blocks(flat) == ("", ["0", "1", "2", "3"])
    assert keep.kept(flat) == ["2", "3"] and keep.describe(flat).endswith(
        "(2 of 4 linear layers, 50%)"
    )
