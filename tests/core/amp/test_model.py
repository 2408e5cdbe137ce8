"""What amp does to a model (:mod:`mpnb.core.amp._model`): what it returns, O1 losses in fp32
(Apex's numerics), any output type kept; the models it refuses; O1's autocast region closed.

O1 casts the model's floating outputs to fp32 at the model boundary, so a loss computed from
them matches ``torch.autocast`` wrapping forward and loss together. At every level, tensors,
tuples, namedtuples, lists, dicts, dataclasses and Hugging Face ``ModelOutput`` come back as
the same type with only their floating tensors cast. A meta-device model and complex params
are refused at ``amp.initialize``; a Ctrl-C inside an O1 forward does not leave autocast on.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

from mpnb import amp
from mpnb.core.amp._initialize import EmulatedHalfWarning

LEVELS = ["O0", "O1", "O2", "O3"]


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 5))


@pytest.mark.parametrize(
    "loss_fn",
    [
        lambda out, t: F.cross_entropy(out, t),
        lambda out, t: F.mse_loss(out, F.one_hot(t, 5).float()),
        lambda out, t: F.binary_cross_entropy_with_logits(out, F.one_hot(t, 5).float()),
        lambda out, t: F.smooth_l1_loss(out, F.one_hot(t, 5).float()),
    ],
)
def test_o1_loss_is_fp32_and_matches_autocast_around_forward_and_loss(loss_fn):
    x, t = torch.randn(32, 6), torch.randint(0, 5, (32,))
    ref_model = _mlp()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = loss_fn(ref_model(x), t)
    model = amp.initialize(_mlp(), opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    loss = loss_fn(model(x), t)
    assert loss.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)


def test_o1_outputs_can_stay_as_autocast_made_them():
    model = amp.initialize(
        _mlp(), opt_level="O1", half_dtype=torch.bfloat16, cast_model_outputs=False, verbosity=0
    )
    assert model(torch.randn(2, 6)).dtype == torch.bfloat16


Pair = collections.namedtuple("Pair", "logits hidden")


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    labels: torch.Tensor
    note: str = "kept"


@dataclasses.dataclass
class DictOut(collections.OrderedDict):
    """Hugging Face's ModelOutput in miniature: an OrderedDict that is also a dataclass."""

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                self[f.name] = v

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)


class Wrap(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.lin, self.kind = torch.nn.Linear(6, 5), kind

    def forward(self, x):
        y = self.lin(x)
        labels = torch.arange(x.shape[0])
        return {
            "tuple": lambda: (y, labels),
            "list": lambda: [y, {"h": y * 2}],
            "namedtuple": lambda: Pair(y, y * 2),
            "dict": lambda: collections.OrderedDict(logits=y, labels=labels),
            "dataclass": lambda: Out(y, labels),
            "dict-dataclass": lambda: DictOut(logits=y),
        }[self.kind]()


def _floats(obj):
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _floats(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _floats(v)]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in _floats(getattr(obj, f.name))]
    return []


@pytest.mark.parametrize(
    "kind", ["tuple", "list", "namedtuple", "dict", "dataclass", "dict-dataclass"]
)
@pytest.mark.parametrize("level", LEVELS)
def test_model_outputs_keep_their_type_at_every_level(level, kind):
    model = Wrap(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = amp.initialize(model, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    out = model(torch.randn(3, 6))
    assert type(out) is type(Wrap(kind)(torch.randn(3, 6)))
    floats = _floats(out)
    assert floats and all(t.dtype == torch.float32 for t in floats)
    if kind == "dataclass":
        assert out.note == "kept" and out.labels.dtype == torch.int64
    if kind == "dict-dataclass":
        assert list(out.keys()) == ["logits"] and out.logits is out["logits"]
    if kind == "namedtuple":
        assert out.hidden.dtype == torch.float32


@pytest.mark.parametrize("level", LEVELS)
def test_hugging_face_model_output_keeps_its_type(level):
    outputs = pytest.importorskip("transformers.modeling_outputs")

    class HF(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 5)

        def forward(self, x, labels=None):
            logits = self.lin(x)
            loss = None if labels is None else F.cross_entropy(logits.float(), labels)
            return outputs.SequenceClassifierOutput(loss=loss, logits=logits)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = amp.initialize(HF(), opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    out = model(torch.randn(3, 6), labels=torch.tensor([0, 1, 2]))
    assert type(out) is outputs.SequenceClassifierOutput
    assert out.logits.dtype == out["logits"].dtype == out[1].dtype == torch.float32
    assert out.loss.dtype == torch.float32 and list(out.keys()) == ["loss", "logits"]


def _init(m, opt, level, half=torch.bfloat16, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedHalfWarning)
        return amp.initialize(m, opt, opt_level=level, half_dtype=half, verbosity=0, **kw)


class _Interrupted(torch.nn.Module):
    """Raises KeyboardInterrupt (a Ctrl-C) in the middle of its forward when ``stop`` is set;
    ``inner`` calls the model again inside its own forward (a re-entrant forward)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.stop = self.inner = False

    def forward(self, x):
        y = self.lin(x)
        if self.stop:
            raise KeyboardInterrupt
        if self.inner:
            self.inner = False
            y = y + self(x.float())
            assert torch.is_autocast_enabled("cpu")  # the outer region is still open
        return y


def test_ctrl_c_in_an_o1_forward_does_not_leave_autocast_on():
    # PyTorch runs always_call forward hooks for Exception only: the region a KeyboardInterrupt
    # leaves open is closed by the next forward, or by removing amp's hooks.
    net = _init(_Interrupted(), None, "O1")
    net.stop = True
    with pytest.raises(KeyboardInterrupt):
        net(torch.randn(2, 4))
    assert torch.is_autocast_enabled("cpu")  # open until the model runs again
    net.stop = False
    assert net(torch.randn(2, 4)).dtype == torch.float32  # O1 casts outputs to fp32
    assert not torch.is_autocast_enabled("cpu")
    net.inner = True  # a re-entrant forward keeps its outer region
    net(torch.randn(2, 4))
    assert not torch.is_autocast_enabled("cpu")

    other = _init(_Interrupted(), None, "O1")
    other.stop = True
    with pytest.raises(KeyboardInterrupt):
        other(torch.randn(2, 4))
    amp.current_handle().remove_hooks()
    assert not torch.is_autocast_enabled("cpu")


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


def test_a_meta_model_is_refused_at_initialize():
    with torch.device("meta"):
        m = _net()
    with pytest.raises(ValueError, match="meta device.*to_empty"):
        amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), opt_level="O2", verbosity=0)


def test_complex_parameters_are_refused_at_initialize():
    m = torch.nn.Linear(4, 4, dtype=torch.complex64)
    with pytest.raises(ValueError, match="complex64.*view_as_real"):
        amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), opt_level="O1", verbosity=0)
