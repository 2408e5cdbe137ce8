"""The machinery of :func:`mpnb.lab.trace_precision`: what is recorded, and how.

Three observers run together during one forward and backward:

* :class:`ModuleTracker`: forward pre/post hooks on every module of the model, and
  ``register_multi_grad_hook`` on each module's outputs (its backward starts) and inputs (its
  backward ends), so every op knows the module it runs in, forward and backward.
* :class:`ApiMode` (a ``TorchFunctionMode``): the torch call the model code made (``F.linear``,
  ``Tensor.float``...) and whether autocast was on when it was made. Inside a
  ``TorchDispatchMode`` handler autocast always reads as off (the dispatcher excludes its key
  below the Python key), so the region's state must be read here, at the call.
* :class:`OpMode` (a ``TorchDispatchMode``): every aten op, its dtypes, FLOPs (torch's
  ``flop_counter`` formulas) and bytes, attributed to the current call and module.

Which autocast list a call is on is measured, not looked up: :func:`autocast_policy` runs the
call again after the trace on its recorded arguments, cast to float32 and to the half dtype,
under ``torch.autocast``, and reads the output dtype.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from mpnb.core import amp

__all__ = ["ModuleTracker", "ApiMode", "OpMode", "Call", "OpFacts", "autocast_policy"]

_HALVES = (torch.float16, torch.bfloat16)
_CAST_OPS = ("_to_copy", "to", "copy_", "_to_copy_out", "copy")
# torch calls whose job is a dtype change
CAST_APIS = frozenset(
    ("to", "float", "half", "bfloat16", "double", "long", "int", "short", "bool", "byte")
    + ("char", "type", "type_as", "copy_", "_to_copy")
)


def _amp_wrapper_code():
    return amp.half_function(lambda: None).__code__  # the code of every amp cast wrapper


@dataclass
class Call:
    """One torch call made by the traced code (the outermost one: nested calls are not seen)."""

    index: int
    name: str
    func: object
    autocast: bool
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    versions: tuple = ()
    wrapper: tuple[str, str] | None = None  # (amp policy, function name) when in an amp wrapper
    wrapper_known: bool = False
    key: tuple | None = None  # (func, input dtypes): calls with one key share an autocast rule


@dataclass
class OpFacts:
    """What was observed about one aten op (the reason is derived later, from these)."""

    phase: str
    module: str
    module_type: str
    fp8_module: bool
    call: Call | None
    op: str
    kind: str
    in_dtypes: tuple
    out_dtypes: tuple
    dtype: str | None
    flops: int
    bytes: int
    grad_fn: str
    inputs_from: tuple = ()  # indices of the ops that made its tensor inputs (-1: none seen)
    op_key: tuple | None = None  # (op, input dtypes): ops with one key share an autocast rule


def _func_name(func) -> str:
    if isinstance(func, torch._ops.OpOverloadPacket):
        return "torch.ops." + func._qualified_op_name.replace("::", ".")
    if isinstance(func, torch._ops.OpOverload):
        return f"torch.ops.{func.namespace}.{func._opname}"
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    mod = getattr(func, "__module__", None) or ""
    if qual.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + qual.split(".", 1)[1]
    if qual.startswith("_VariableFunctionsClass."):
        return "torch." + qual.split(".", 1)[1]
    if mod.startswith("torch._C._nn"):
        mod = "torch.nn.functional"
    return f"{mod}.{qual}" if mod and mod != "torch._C" else f"torch.{qual}"


class ModuleTracker:
    """Which module of ``model`` runs now, in forward (a stack) and in backward (hooks)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._fwd: list[tuple[str, torch.nn.Module]] = []
        self._bwd: dict[str, tuple[tuple[int, int], torch.nn.Module]] = {}
        self._handles: list = []
        self.ops_seen = 0  # advanced by OpMode: modules entered between two ops entered together
        for name, mod in model.named_modules():
            name = name or "(root)"
            self._handles += [
                mod.register_forward_pre_hook(self._pre(name), prepend=True),
                mod.register_forward_hook(self._post(name), always_call=True),
            ]

    def _pre(self, name):
        def hook(mod, args):
            self._fwd.append((name, mod))
            ins = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
            ins = [t for t in ins if t.requires_grad]
            if ins:
                self._handles.append(
                    register_multi_grad_hook(ins, lambda g: self._bwd.pop(name, None))
                )

        return hook

    def _post(self, name):
        def hook(mod, args, out):
            if self._fwd and self._fwd[-1][0] == name:
                self._fwd.pop()
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            outs = [t for t in outs if t.requires_grad]
            if outs:

                def enter(grads):
                    # one output shared by nested modules: the innermost (deepest) wins
                    depth = 0 if name == "(root)" else name.count(".") + 1
                    self._bwd[name] = ((self.ops_seen, depth), mod)

                self._handles.append(register_multi_grad_hook(outs, enter))

        return hook

    def current(self, backward: bool) -> tuple[str, torch.nn.Module | None]:
        """``(qualified name, module)`` of the innermost module running now, or ``("-", None)``."""
        if backward:
            if not self._bwd:
                return "-", None
            name = max(self._bwd, key=lambda n: self._bwd[n][0])
            return name, self._bwd[name][1]
        return self._fwd[-1] if self._fwd else ("-", None)

    def remove(self) -> None:
        """Remove every hook this tracker registered."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


class ApiMode(TorchFunctionMode):
    """Records the current outermost torch call and the autocast state when it was made."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.current: Call | None = None
        self.samples: dict[tuple, Call] = {}
        self._count = itertools.count()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        outer = self.current
        on = torch.is_autocast_enabled(self.device_type)
        self.current = Call(next(self._count), _func_name(func), func, on)
        try:
            return func(*args, **kwargs)
        finally:
            call, self.current = self.current, outer
            if on and call.name.split(".")[-1] not in CAST_APIS:
                self._keep_sample(call, args, kwargs)

    def _keep_sample(self, call: Call, args, kwargs) -> None:
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        key = call.key = (call.func, tuple(t.dtype for t in flat))
        if key not in self.samples:
            call.args, call.kwargs = args, kwargs
            call.versions = tuple(t._version for t in flat)
            self.samples[key] = call


class OpMode(TorchDispatchMode):
    """Records :class:`OpFacts` for every aten op."""

    def __init__(self, tracker: ModuleTracker, api: ApiMode, fp8_types: tuple) -> None:
        super().__init__()
        self.tracker, self.api, self.fp8_types = tracker, api, fp8_types
        self.phase = "forward"
        self.ops: list[OpFacts] = []
        self.samples: dict[tuple, Call] = {}  # one autocast-region call per op key, to re-run
        self.loss_scale_nodes: set = set()  # autograd nodes of amp's loss scaling
        self._made: dict[int, tuple[weakref.ref, int]] = {}  # id(tensor) -> (tensor, its op)
        self._wrapper_code = _amp_wrapper_code()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append(self._facts(func, args, kwargs, out))
        return out

    def _facts(self, func, args, kwargs, out) -> OpFacts:
        self.tracker.ops_seen += 1
        backward = torch._C._current_graph_task_id() != -1
        phase = "backward" if backward and self.phase != "loss-scaling" else self.phase
        name, mod = self.tracker.current(backward)
        call = None if backward else self.api.current
        if call is not None and not call.wrapper_known:
            call.wrapper, call.wrapper_known = self._find_wrapper(), True
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        kind = _kind(func, ins, outs)
        node = torch._C._current_autograd_node() if backward else None
        if node is not None and node in self.loss_scale_nodes:
            phase = "loss-scaling"  # the backward of amp's loss * scale
        key = None
        if call is not None and call.autocast and kind == "compute":
            key = (func, tuple(t.dtype for t in ins))
            if key not in self.samples:
                versions = tuple(t._version for t in ins)
                self.samples[key] = Call(-1, _op_name(func), func, True, args, kwargs, versions)
        inputs_from = tuple(self._maker(t) for t in ins)
        for t in outs:
            self._made[id(t)] = (weakref.ref(t), len(self.ops))
        return OpFacts(
            phase=phase,
            module=name,
            module_type=type(mod).__name__ if mod is not None else "-",
            fp8_module=isinstance(mod, self.fp8_types),
            call=call,
            op=_op_name(func),
            kind=kind,
            in_dtypes=tuple(_dt(t.dtype) for t in ins),
            out_dtypes=tuple(_dt(t.dtype) for t in outs),
            dtype=_compute_dtype(func, kind, ins, outs),
            flops=_flops(func, args, kwargs, out),
            bytes=0 if kind == "view" else _bytes(ins, outs),
            grad_fn=node.name() if node is not None else "",
            inputs_from=inputs_from,
            op_key=key,
        )

    def _maker(self, t: torch.Tensor) -> int:
        """The index of the op that made ``t`` (-1: made outside the trace)."""
        ref, index = self._made.get(id(t), (None, -1))
        return index if ref is not None and ref() is t else -1

    def _find_wrapper(self):
        f = sys._getframe(3)
        for _ in range(200):
            if f is None:
                return None
            if f.f_code is self._wrapper_code:
                fn = f.f_locals.get("fn")
                return f.f_locals.get("policy", "?"), getattr(fn, "__qualname__", repr(fn))
            f = f.f_back
        return None


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _op_name(func) -> str:
    ns = func.namespace
    return func._opname if ns == "aten" else f"{ns}.{func._opname}"


def _kind(func, ins, outs) -> str:
    if func.is_view:
        return "view"
    if func._opname in _CAST_OPS and ins and outs and ins[0].dtype != outs[0].dtype:
        return "cast"
    return "compute"


def _compute_dtype(func, kind, ins, outs) -> str | None:
    if kind == "cast":
        return _dt(outs[0].dtype)
    floats = [t.dtype for t in ins if t.is_floating_point()]
    if func._opname == "_scaled_mm":
        return "+".join(sorted({_dt(d) for d in floats if d.itemsize == 1}))
    if not floats:
        floats = [t.dtype for t in outs if t.is_floating_point()]
        return _dt(floats[0]) if floats else None
    try:
        wide = floats[0]
        for d in floats[1:]:
            wide = torch.promote_types(wide, d)
        return _dt(wide)
    except RuntimeError:  # float8 dtypes do not promote
        return "+".join(sorted({_dt(d) for d in floats}))


def _flops(func, args, kwargs, out) -> int:
    formula = flop_registry.get(func.overloadpacket)
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a formula that cannot read these args counts as 0
        return 0


def _bytes(ins, outs) -> int:
    seen, total = set(), 0
    for t in (*ins, *outs):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _as(x, dtype):
    if isinstance(x, torch.Tensor) and x.dtype in (torch.float32, *_HALVES):
        return x.detach().to(dtype)
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    return x


def _first_float_dtype(out):
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.dtype
    return None


class _CastCounter(TorchDispatchMode):
    """Counts the floating dtype changes a call makes (to see the casts autocast inserts)."""

    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a for a in args if isinstance(a, torch.Tensor)]
        self.casts += _kind(func, ins, tree_flatten(out)[0]) == "cast"
        return out


def _run(call: Call, transform, device_type, half, autocast: bool):
    args = tree_map(transform, call.args)
    kwargs = tree_map(transform, call.kwargs)
    counter = _CastCounter()
    with torch.autocast(device_type, dtype=half, enabled=autocast), counter:
        out = call.func(*args, **kwargs)
    return _first_float_dtype(out), counter.casts


def autocast_policy(call: Call, device_type: str, half: torch.dtype) -> str:
    """Which autocast rule ``call`` follows, measured by running it again.

    Returns ``"lower-precision"`` (float32 inputs give a half output), ``"fp32"`` (half inputs
    give a float32 output), ``"promote"`` (mixed inputs: autocast inserts casts that the same
    call without autocast does not), ``"none"`` (the output follows the inputs), or
    ``"unknown"`` (the call could not be re-run on its recorded arguments).
    """
    flat = [t for t in tree_flatten((call.args, call.kwargs))[0] if isinstance(t, torch.Tensor)]
    if not any(t.is_floating_point() for t in flat):
        return "none"  # autocast casts floating tensor arguments only
    if tuple(t._version for t in flat) != call.versions:
        return "unknown"  # an argument was changed in place after the call
    try:
        devices = [torch.cuda.current_device()] if device_type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            to32, toh = (lambda x: _as(x, torch.float32)), (lambda x: _as(x, half))
            o32, c32 = _run(call, to32, device_type, half, True)
            oh, ch = _run(call, toh, device_type, half, True)
            if o32 is None or oh is None:  # no floating output: did autocast cast anything?
                base = (
                    _run(call, to32, device_type, half, False)[1],
                    _run(call, toh, device_type, half, False)[1],
                )
                return "none" if (c32, ch) == base else "unknown"
            if o32 == half:
                return "lower-precision"
            if o32 == torch.float32 and oh == torch.float32:
                return "fp32"
            if o32 != torch.float32 or oh != half:
                return "unknown"
            return _promote_or_none(call, flat, device_type, half)
    except Exception:  # noqa: BLE001 - any failure to re-run means we do not know
        return "unknown"


def _promote_or_none(call: Call, flat: list, device_type: str, half: torch.dtype) -> str:
    """Whether autocast casts mixed inputs of ``call`` to their widest dtype (promote list).

    The inputs as recorded may already share one dtype (an aten op sees them after autocast's
    casts), so the call is re-run with the first floating input in ``half`` and the others in
    float32: a promote-list op then gets casts that the same call without autocast does not.
    """
    floats = [t for t in flat if t.is_floating_point()]
    keep = lambda x: _as(x, x.dtype) if isinstance(x, torch.Tensor) else x  # noqa: E731
    if len(floats) < 2:
        return "none"  # one floating input: nothing to promote
    first = floats[0]
    mixed = lambda x: _as(x, half if x is first else torch.float32)  # noqa: E731
    for transform in (mixed, keep):
        try:
            _, with_ac = _run(call, transform, device_type, half, True)
            _, without = _run(call, transform, device_type, half, False)
        except Exception:  # noqa: BLE001 - mixed dtypes this op refuses: try the recorded ones
            continue
        return "promote" if with_ac > without else "none"
    return "unknown"
