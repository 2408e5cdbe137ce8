"""Keep-lists in the lab: the GPT workload's blocks and head, the row that says what was kept,
and ``sweep_kept``: one row per number of last blocks kept, and the figure of loss against the
share kept (a tiny model, 2 steps)."""

import pytest
import torch
from torch import nn

import mpnb.lab
import mpnb.lab.keep_sweep as keep_sweep
from mpnb.core.fp8.keep import KeepList, find_blocks
from mpnb.core.precision_configs import get_config
from mpnb.lab import workloads
from mpnb.lab._rows import split_warnings


class Tiny(nn.Module):
    """3 blocks of one linear layer each between an input layer and a head: 5 linear layers
    (few: the lab's memory-tracked step follows every Python call of the emulated recipes)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)


RUN = dict(data=_data(), steps=2, batch_sizes=(16,), progress=False, threads=1)


def _gpt(size: str) -> nn.Module:
    return workloads.get("transformer", size).model_fn()


def _block(i: int) -> list[str]:
    return [f"blocks.{i}.{n}" for n in ("qkv", "proj", "mlp.0", "mlp.2")]


@pytest.mark.parametrize(
    "spec, want",
    [
        ("keep-last=1", _block(1)),
        ("keep-first=1", _block(0)),
        ("keep=head", ["head"]),
        ("keep=blocks.*.mlp.*", [f for i in (0, 1) for f in _block(i)[2:]]),
        ("keep-last=15%:keep-head", [*_block(1), "head"]),  # the NVFP4 default, 2 blocks
    ],
)
def test_the_gpt_workloads_blocks_and_head(spec, want):
    model = _gpt("small")
    assert find_blocks(model) == ("blocks", ["blocks.0", "blocks.1"])
    assert KeepList.parse(spec).kept(model) == want


def test_the_nvfp4_default_follows_the_workloads_depth():
    keep = get_config("nvfp4").keep_list()
    medium = _gpt("medium")  # 4 blocks: ceil(0.6) = 1, and the head
    assert keep.describe(medium) == "kept in fp32: blocks.3, head (5 of 17 linear layers, 29%)"
    with pytest.raises(ValueError, match="keep at most 2") as e:
        KeepList(last=3).kept(_gpt("small"))
    assert "TinyLM has 2 blocks" in str(e.value)
    with pytest.raises(ValueError, match="keep='lm_head'") as e:
        KeepList(names=("lm_head",)).kept(_gpt("small"))
    assert "matches no nn.Linear" in str(e.value)


def test_the_row_says_what_was_kept_and_a_plain_row_is_unchanged():
    df = mpnb.lab.compare(Tiny, configs=("O0", "mxfp8:keep-last=1:keep-head", "mxfp8"), **RUN)
    rows = {r.opt_level: r for r in df.itertuples()}
    kept, plain = rows["mxfp8:keep-last=1:keep-head"], rows["mxfp8"]
    assert kept.status == plain.status == "ok"
    assert kept.configuration == "mxfp8:keep-last=1:keep-head b16"
    want = "mxfp8:keep-last=1:keep-head: kept in fp32: blocks.2, head (2 of 5 linear layers, 40%)"
    assert want in split_warnings(kept.warnings)
    assert "kept in" not in plain.warnings and "keep" not in plain.snippet
    assert 'keep="keep-last=1:keep-head"' in kept.snippet
    assert kept.final_loss != plain.final_loss  # the kept layers trained in fp32


def test_the_sweep_is_one_row_per_n_and_a_figure():
    df = mpnb.lab.sweep_kept(Tiny, "nvfp4", last=(0, 1, 3, "all"), **RUN)  # "all" is 3
    assert list(df["kept_last"]) == [0, 1, 3] and df.attrs["blocks"] == 3
    assert list(df["kept_layers"]) == [0, 1, 3] and set(df["linear_layers"]) == {5}
    assert list(df["kept_share"]) == [0.0, 1 / 5, 3 / 5]
    assert list(df["configuration"]) == [
        "nvfp4:keep-none b16",
        "nvfp4:keep-last=1 b16",
        "nvfp4:keep-last=3 b16",
    ]
    assert (df["status"] == "ok").all()
    rows = df.attrs["compare"]
    assert list(rows["opt_level"]) == [
        "O0",
        "nvfp4:keep-none",
        "nvfp4:keep-last=1",
        "nvfp4:keep-last=3",
    ]
    o0 = rows["final_loss"].iloc[0]
    assert df["loss_gap_vs_O0"].tolist() == pytest.approx((df["final_loss"] - o0).tolist())
    assert df["loss_gap_rel"].tolist() == pytest.approx((df["loss_gap_vs_O0"] / o0).tolist())
    fig = df.attrs["figure"]
    (line,) = fig.data
    assert list(line.x) == list(df["kept_share"]) and list(line.y) == list(df["final_loss"])
    assert list(line.text) == ["last 0", "last 1", "last 3"] and line.name == "nvfp4 b16"
    assert [s["y0"] for s in fig.layout.shapes] == [o0]  # O0's loss, dashed
    assert "share of linear layers kept" in fig.layout.xaxis.title.text


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(last=(1, 4)), r"Tiny has 3 blocks \(blocks.0 .. blocks.2\); keep at most 3"),
        (dict(last=(1, 1)), "give each number of last blocks once"),
        (dict(last=(-1,)), "-1 is not a number of blocks"),
        (dict(config="O2"), "O2 to sweep; the sweep varies the keep-list .*give one or more of"),
        (dict(config=("nvfp4", "nvfp4:keep-head")), "names a configuration twice"),
        (dict(configs=("O0",)), "drop configs="),
    ],
)
def test_the_sweep_refuses_before_anything_trains(kwargs, match, monkeypatch):
    monkeypatch.setattr(keep_sweep, "compare", None)  # it must not get that far
    with pytest.raises((ValueError, TypeError), match=match):
        mpnb.lab.sweep_kept(Tiny, **{"config": "nvfp4", "last": (0,), **kwargs, **RUN})
