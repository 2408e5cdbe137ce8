"""The ``mpnb`` operator library: each op defined once, from its annotated reference.

An op family module (``scale.py``, ``adam.py``, ``layer_norm.py``...) writes each op's
pure-PyTorch reference with type annotations and a docstring. That function is the one place
in Python where the op's arguments are spelled; :func:`define` derives the rest from it::

    def reference_my_scale(x: Tensor, s: float = 1.0) -> Tensor:
        \"\"\"``x * s`` (the op's documentation: Args, Example).\"\"\"
        return x * s

    OP = define(reference_my_scale, family="demo", check=_check)
    my_scale = OP.wrapper

* the schema (``torch.ops.mpnb.<name>``, the name is the reference's without ``reference_``):
  the annotations give the types (``Tensor``, ``Tensor | None``, ``Sequence[Tensor]``,
  ``float``, ``int``, ``bool``, ``str``, ``Sequence[int]``, ``Sequence[bool]``; returns
  ``None``, ``Tensor`` or a tuple of tensors), ``mutates`` the arguments written in place
  (``Tensor(a!)``), the reference's defaults the schema's;
* the public wrapper: a function with the reference's signature and docstring (keyword-only
  arguments where the reference has them: a row of floats is an order trap) that checks the
  arguments and calls ``torch.ops.mpnb.<name>``. It is generated once, at definition, with
  the call written out, so a call costs what a hand-written wrapper costs;
* the kernels, registered through ``torch.library`` and nothing else: the reference as the
  ``CompositeExplicitAutograd`` kernel (every device without a kernel of its own: the CPU
  before the C++ library is loaded or with ``MPNB_DISABLE_EXT=1``); for the CUDA key our
  Triton kernel (``triton=``, a module of :mod:`mpnb.core.ops.triton`) when a GPU run
  measured it at least PyTorch's speed or the user opted in (``MPNB_TRITON=1``), else the
  PyTorch-ops path (``cuda=``) when the family has one, else the reference; the fake; the
  autograd formula of a differentiable op.

Every Python implementation other than the reference (the check, the fake, the PyTorch-ops
path, the Triton launcher, the autograd context) takes the call as one object, ``args``, a
named tuple of the reference's parameters, and reads the arguments by name (``args.lr``):
adding a parameter edits the reference and the code that uses it, nothing else.

The C++ kernels register themselves for the CPU key (``TORCH_LIBRARY_IMPL(mpnb, CPU, m)`` at
the bottom of ``csrc/cpu/<family>.cpp``) when :func:`ensure_kernels` loads the library; from
then on the dispatcher picks them. There is no other path to an op.

Argument checks, written once: each op's ``check(args, per_tensor)`` holds every check and
every message (naming the problem and the fix). The wrapper runs it before it dispatches,
with ``per_tensor=False``: what costs O(1) per list (lengths, the first tensor's dtype, the
scalars, the shapes of single tensors). The per-tensor checks (each tensor's size, dtype,
layout and device) would cost a Python loop over lists of thousands of tensors on every
optimizer step, so the wrapper runs them only when a kernel refused the call, to replace the
kernel's short refusal by the named one. The devices of an op's tensors (every list on one
device, no meta tensor beside real ones) are checked in one place for every op,
:func:`~mpnb.core.ops._checks.check_devices`: with the per-tensor checks, and in the fake,
where a call holding a meta tensor lands (the Meta key) and would otherwise write nothing.
Each kernel therefore guards its own memory: the C++ kernels with cheap ``TORCH_CHECK``s
of sizes, dtypes, layouts and devices (short messages, no second copy of the text); PyTorch's
ops on the PyTorch path with their own checks; the reference and the Triton launchers (which
read raw addresses) run the whole check, ``per_tensor=True``, before they start, except a list
launcher that guards its lists itself (``guards_lists``: the per-tensor checks in one pass,
:func:`~mpnb.core.ops.triton._checks.guard_lists`), whose refusal the whole check names. A direct
``torch.ops.mpnb.<name>`` call skips the wrapper: nothing is read or written out of bounds,
but the O(1) checks of values that no kernel needs for its memory (a causal softmax on
non-square scores, ``min_scale > max_scale``...) are the wrapper's alone, and the fakes and
kernels assume them.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import inspect
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mpnb.core.ops import triton as _triton
from mpnb.core.ops._build import cpu_extension
from mpnb.core.ops._checks import check_devices
from mpnb.core.ops._layout import memory_order_views

__all__ = [
    "LIB",
    "OpInfo",
    "Sample",
    "Tensor",
    "Tensors",
    "call",
    "define",
    "all_ops",
    "op_info",
    "ensure_kernels",
    "kernels_loaded",
    "use_reference",
    "use_torch_path",
    "op_path",
]

#: The library that owns the ``mpnb`` namespace (schemas, references, fakes, autograd).
LIB = torch.library.Library("mpnb", "DEF")

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

#: The annotations of the references: a tensor, and a list of tensors (``Tensor[]``).
Tensor = torch.Tensor
Tensors = Sequence[torch.Tensor]

#: What a refused call raises (a kernel's ``TORCH_CHECK``, a check, a PyTorch op's refusal).
_REFUSALS = (RuntimeError, ValueError, TypeError, IndexError)


@dataclass
class Sample:
    """One call of an op for the tests: its arguments by name (fresh tensors each time it is
    built)."""

    kwargs: dict
    name: str = ""


# ---- the schema, read off the reference's annotations ---------------------------------------

_SCALARS = {float: "float", int: "int", bool: "bool", str: "str"}


def _schema_type(hint: Any, what: str) -> str:
    if hint is torch.Tensor:
        return "Tensor"
    if hint in _SCALARS:
        return _SCALARS[hint]
    origin, inner = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [t for t in inner if t is not type(None)]
        if len(rest) == 1 and len(inner) == 2 and rest[0] is torch.Tensor:
            return "Tensor?"
    if origin in (list, Sequence, collections.abc.Sequence) and len(inner) == 1:
        if inner[0] is torch.Tensor:
            return "Tensor[]"
        if inner[0] in (int, bool, float):
            return f"{_SCALARS[inner[0]]}[]"
    raise TypeError(
        f"{what}: annotation {hint!r} has no schema type; use Tensor, Tensor | None, "
        "Sequence[Tensor], float, int, bool, str, Sequence[int] or Sequence[bool]."
    )


def _return_type(hint: Any, what: str) -> str:
    if hint is None or hint is type(None):
        return "()"
    if hint is torch.Tensor:
        return "Tensor"
    if typing.get_origin(hint) is tuple and all(t is torch.Tensor for t in typing.get_args(hint)):
        return "(" + ", ".join("Tensor" for _ in typing.get_args(hint)) + ")"
    raise TypeError(
        f"{what}: return annotation {hint!r} is not None, Tensor or tuple[Tensor, ...]."
    )


def _default(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        return f'"{value}"'
    raise TypeError(f"default {value!r} has no schema form")


def _trailing_defaults(params: Sequence[inspect.Parameter]) -> list[Any]:
    """The defaults a positional call can leave out: the last run of defaulted parameters
    (a keyword-only reference may give defaults before a required argument; the schema,
    whose arguments are all positional, cannot)."""
    out: list[Any] = []
    for p in reversed(params):
        if p.default is inspect.Parameter.empty:
            break
        out.insert(0, p.default)
    return out


def infer_schema(name: str, reference: Callable, mutates: Iterable[str] = ()) -> str:
    """The ``torch.library`` schema of op ``name`` from ``reference``'s annotations.

    ``mutates`` names the arguments the op writes (``Tensor(a!)``, aliases lettered in order).
    Every argument is positional in the schema, keyword-only ones too: the wrapper passes
    them by position (the dispatcher parses keywords at a cost of microseconds per call) and
    the reference's keyword-only marker guards the Python callers.

    Example::

        >>> def reference_my_scale(x: Tensor, s: float = 1.0) -> Tensor: ...
        >>> infer_schema("my_scale", reference_my_scale)
        'my_scale(Tensor x, float s=1.0) -> Tensor'
    """
    hints = typing.get_type_hints(reference)
    params = list(inspect.signature(reference).parameters.values())
    mutates = set(mutates)
    unknown = mutates - {p.name for p in params}
    if unknown:
        raise ValueError(f"{name}: mutates names {sorted(unknown)}, which are no arguments.")
    n_defaults = len(_trailing_defaults(params))
    out, letters = [], iter("abcdefghijklmnopqrstuvwxyz")
    for i, p in enumerate(params):
        if p.name not in hints:
            raise TypeError(f"{name}: argument {p.name!r} of the reference has no annotation.")
        ty = _schema_type(hints[p.name], f"{name}({p.name})")
        if p.name in mutates:
            if not ty.startswith("Tensor"):
                raise TypeError(f"{name}: only tensors can be written in place, not {p.name!r}.")
            ty = f"Tensor({next(letters)}!){ty[len('Tensor') :]}"
        default = f"={_default(p.default)}" if i >= len(params) - n_defaults else ""
        out.append(f"{ty} {p.name}{default}")
    returns = _return_type(hints.get("return", inspect.Parameter.empty), name)
    return f"{name}({', '.join(out)}) -> {returns}"


def call(fn: Callable, args: Any) -> Any:
    """``fn`` called with an op's ``args`` by name (a reference from another implementation:
    ``call(reference_fused_adam_, args)`` where PyTorch's ops lack an option)."""
    return fn(**args._asdict())


# ---- the op table ---------------------------------------------------------------------------


@dataclass(eq=False)
class OpInfo:
    """One op: its schema and everything the dispatcher and the tests need to know about it.

    Attributes:
        name: the op's name in the ``mpnb`` namespace (``torch.ops.mpnb.<name>``).
        family: the module that defines it (``mpnb/core/ops/<family>.py``, and the kernel in
            ``csrc/cpu/<family>.cpp``).
        schema: the ``torch.library`` schema, inferred from the reference.
        reference: the pure-PyTorch implementation, the op's one written signature.
        Args: the named tuple of the reference's parameters (with its defaults): the ``args``
            every other implementation receives.
        check: ``check(args, per_tensor)``, raising on bad arguments (or None).
        fake: the fake (meta) kernel, ``fake(args)``.
        cuda: PyTorch's own ops for CUDA, ``cuda(args)``, or None.
        triton: the module of :mod:`mpnb.core.ops.triton` whose function ``<name>(args)`` is
            the Triton launcher, or None.
        memory_order: list arguments that may be handed over in memory order (channels-last
            tensors, :mod:`mpnb.core.ops._layout`) when a kernel refuses them as given.
        returns: the argument the wrapper returns (an in-place op's result), or None.
        dtypes: the floating dtypes the op accepts (the tests sweep them).
        sample_inputs: ``sample_inputs(dtype) -> iterable of Sample``, for the parity tests.
        tolerance: ``{dtype: (rtol, atol)}`` of kernel vs reference (``(0, 0)``: bitwise).
        cpu_kernel: a C++ CPU kernel of ours exists.
        wrapper: the public function (set by :func:`define`).
    """

    name: str
    family: str
    schema: str
    reference: Callable
    Args: type
    check: Callable[[Any, bool], None] | None = None
    fake: Callable | None = None
    cuda: Callable | None = None
    triton: str | None = None
    memory_order: tuple[str, ...] = ()
    returns: str | None = None
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    sample_inputs: Callable[[torch.dtype], Iterable[Sample]] | None = None
    tolerance: dict = field(default_factory=dict)
    cpu_kernel: bool = True
    wrapper: Callable = field(init=False, repr=False)

    @property
    def qualname(self) -> str:
        """``"mpnb::<name>"``."""
        return f"mpnb::{self.name}"

    @property
    def overload(self) -> torch._ops.OpOverload:
        """``torch.ops.mpnb.<name>.default``."""
        return getattr(torch.ops.mpnb, self.name).default

    def args(self, *args: Any, **kwargs: Any) -> Any:
        """The call as the named tuple the implementations take (defaults filled in)."""
        return self.Args(*args, **kwargs)

    def validate(self, args: Any) -> None:
        """Every check of the op on ``args`` (the per-tensor ones too); raise on the first
        problem, with its message."""
        check_devices(args)
        if self.check is not None:
            self.check(args, True)

    # -- the Python kernels the dispatcher calls, positional as the schema passes them --

    def _checked(self, impl: Callable, per_tensor: bool, spread: bool) -> Callable:
        Args, check = self.Args, self.check

        def kernel(*args, **kwargs):
            a = Args(*args, **kwargs)
            if per_tensor:
                check_devices(a)
            if check is not None:
                check(a, per_tensor)
            try:
                return impl(**a._asdict()) if spread else impl(a)
            except _REFUSALS as e:
                if per_tensor or check is None:
                    raise
                _explain(check, a, e)
                raise

        kernel.__name__ = kernel.__qualname__ = f"{self.name}_{getattr(impl, '__name__', 'k')}"
        kernel.__signature__ = inspect.signature(self.reference)
        return kernel

    @property
    def reference_kernel(self) -> Callable:
        """The reference behind its check: what the dispatcher runs where no kernel is ours."""
        return self._checked(self.reference, per_tensor=True, spread=True)

    @property
    def torch_path(self) -> Callable | None:
        """The PyTorch-ops path as the dispatcher calls it (positional), or None."""
        if self.cuda is None:
            return None
        return self._checked(self.cuda, per_tensor=False, spread=False)

    def triton_kernel(self) -> Callable:
        """The Triton launcher as the dispatcher calls it (imports triton and the kernel
        module; the launcher reads raw addresses, so the whole check runs first, unless the
        launcher guards its lists itself, ``guards_lists``: one pass over every tensor,
        :func:`~mpnb.core.ops.triton._checks.guard_lists`, whose refusal the whole check names)."""
        module = importlib.import_module(f"{_triton.__name__}.{self.triton}")
        launcher = getattr(module, self.name)
        per_tensor = not getattr(launcher, "guards_lists", False)
        return self._checked(launcher, per_tensor=per_tensor, spread=False)

    def _refused(self, args: Any, error: BaseException) -> Any:
        """The wrapper's answer to a refused call: retry with dense tensors in memory order
        when the op takes them, else raise the check's named error (or the kernel's)."""
        if self.memory_order:
            views = memory_order_views(args, self.memory_order)
            if views is not None:
                try:
                    return self.overload(*views)
                except _REFUSALS as e:
                    args, error = views, e
        if self.check is not None:
            _explain(self.check, args, error)
        raise error


def _explain(check: Callable, args: Any, error: BaseException) -> None:
    """Run the whole check after a kernel refused ``args``; its named error replaces the
    kernel's short one. Returns when the check finds nothing, or finds the very message the
    refusal carries (a Python kernel's own check): the caller re-raises ``error``."""
    try:
        check_devices(args)
        check(args, True)
    except (ValueError, TypeError) as named:
        if type(named) is type(error) and str(named) == str(error):
            return
        raise named from error


_TABLE: dict[str, OpInfo] = {}
_TRITON_ON_CUDA: set[str] = set()  # ops whose CUDA kernel is our Triton kernel


def define(
    reference: Callable,
    *,
    family: str,
    mutates: Iterable[str] = (),
    check: Callable[[Any, bool], None] | None = None,
    fake: Callable | None = None,
    cuda: Callable | None = None,
    triton: str | None = None,
    autograd: tuple[Callable, Callable] | None = None,
    memory_order: Sequence[str] = (),
    returns: str | None = None,
    **info: Any,
) -> OpInfo:
    """Define op ``mpnb::<name>`` from its annotated reference; returns its :class:`OpInfo`,
    whose ``wrapper`` is the public function (see the module docstring).

    Args:
        reference: ``reference_<name>``, annotated; its docstring documents the op.
        family: the defining module's short name.
        mutates: the arguments the op writes in place.
        check: ``check(args, per_tensor)``, every argument check of the op.
        fake: ``fake(args)``: the outputs' shapes and dtypes (default: no outputs).
        cuda: ``cuda(args)``: PyTorch's own ops, registered for CUDA.
        triton: the module of :mod:`mpnb.core.ops.triton` holding the launcher ``<name>``.
        autograd: ``(backward, setup_context)`` of a differentiable op; ``setup_context``
            gets ``(ctx, args, output)`` and ``backward`` may return ``{argument: grad}``.
        memory_order: list arguments a refused call may retry in memory order.
        returns: the argument the wrapper returns (an in-place op's result).
        **info: the remaining :class:`OpInfo` fields (dtypes, sample_inputs, tolerance...).

    Example::

        >>> def reference_my_scale(x: Tensor, s: float = 1.0) -> Tensor:
        ...     \"\"\"``x * s``.\"\"\"
        ...     return x * s
        >>> my_scale = define(reference_my_scale, family="demo",
        ...                   fake=lambda args: torch.empty_like(args.x)).wrapper
    """
    name = reference.__name__.removeprefix("reference_")
    schema = infer_schema(name, reference, mutates)
    params = list(inspect.signature(reference).parameters.values())
    defaults = _trailing_defaults(params)
    Args = collections.namedtuple(f"{name}_args", [p.name for p in params], defaults=defaults)
    Args.__doc__ = f"The arguments of mpnb::{name}, by name (the reference's parameters)."
    Args.op_name = name  # the checks' messages start with it
    op = OpInfo(name, family, schema, reference, Args, check, fake, cuda, triton, **info)
    op.memory_order, op.returns = tuple(memory_order), returns
    LIB.define(schema)
    LIB.impl(name, op.reference_kernel, "CompositeExplicitAutograd")
    if triton is not None:
        _triton.register(name, triton, op.triton_kernel)
    kernel = op.torch_path
    if triton is not None and _triton.enabled_for(name):  # measured, or MPNB_TRITON=1
        kernel = op.triton_kernel()
        _TRITON_ON_CUDA.add(name)
    if kernel is not None:
        LIB.impl(name, kernel, "CUDA")
    torch.library.register_fake(op.qualname, _fake(Args, fake or _no_outputs), lib=LIB)
    if autograd is not None:
        backward, setup_context = autograd
        torch.library.register_autograd(
            op.qualname,
            _grads_by_name(Args, backward),
            setup_context=lambda ctx, inputs, output: setup_context(ctx, Args(*inputs), output),
            lib=LIB,
        )
    op.wrapper = _wrapper(op)
    _TABLE[name] = op
    return op


def _no_outputs(args: Any) -> None:
    return None


def _fake(Args: type, fn: Callable) -> Callable:
    """The fake as registered: the devices checked first. A call with a meta tensor beside
    real ones dispatches here (the Meta key) and would write nothing; it is refused instead
    (:func:`~mpnb.core.ops._checks.check_devices`)."""

    def fake(*args, **kwargs):
        a = Args(*args, **kwargs)
        check_devices(a)
        return fn(a)

    return fake


def _grads_by_name(Args: type, backward: Callable) -> Callable:
    def by_position(ctx, *grads):
        out = backward(ctx, *grads)
        if isinstance(out, dict):
            return tuple(out.get(n) for n in Args._fields)
        return out

    return by_position


def _wrapper(op: OpInfo) -> Callable:
    """The public function of ``op``: the reference's signature, the check, the call.

    Written out as source once (the way ``dataclasses`` writes ``__init__``): the call costs
    one named tuple, the check and the op, with no binding of arguments at run time.
    """
    params = list(inspect.signature(op.reference).parameters.values())
    names = [p.name for p in params]
    if op.returns is not None and op.returns not in names:
        raise ValueError(f"{op.name}: returns={op.returns!r} is no argument.")
    header, env = [], {}
    for p in params:
        if p.kind is inspect.Parameter.KEYWORD_ONLY and "*" not in header:
            header.append("*")
        if p.default is inspect.Parameter.empty:
            header.append(p.name)
        else:
            env[f"_default_{p.name}"] = p.default
            header.append(f"{p.name}=_default_{p.name}")
    call = ", ".join(names)
    lines = [
        f"def {op.name}({', '.join(header)}):",
        "    if not _loaded[0]:",
        "        _ensure()",
        f"    _args = _Args({call})",
    ]
    if op.check is not None:
        lines.append("    _check(_args, False)")
    lines += [
        "    try:",
        "        _out = _op(*_args)",
        "    except _REFUSALS as _error:",
        "        _out = _refused(_args, _error)",
        f"    return {op.returns or '_out'}",
    ]
    env |= {"_loaded": _loaded, "_ensure": ensure_kernels, "_Args": op.Args, "_check": op.check}
    env |= {"_op": op.overload, "_REFUSALS": _REFUSALS, "_refused": op._refused}
    exec("\n".join(lines), env)  # noqa: S102 - our own source, built from the signature
    fn = env[op.name]
    fn.__module__ = op.reference.__module__
    fn.__qualname__ = op.name
    fn.__doc__ = op.reference.__doc__
    fn.__annotations__ = dict(op.reference.__annotations__)
    if op.returns is not None:
        fn.__annotations__["return"] = fn.__annotations__[op.returns]
    return fn


def all_ops() -> list[OpInfo]:
    """Every defined op, in definition order (importing ``mpnb.core.ops`` defines them all)."""
    return list(_TABLE.values())


def op_info(name: str) -> OpInfo:
    """The :class:`OpInfo` of ``mpnb::name`` (KeyError naming the known ops otherwise)."""
    try:
        return _TABLE[name]
    except KeyError:
        raise KeyError(f"no mpnb op named {name!r}; known ops: {sorted(_TABLE)}") from None


_loaded = [False]  # one element: a module global read on every op call
_REFERENCE_ON_CPU: set[str] = set()  # ops use_reference() switched, while its block runs


def ensure_kernels() -> bool:
    """Build (on first use) and load the C++ kernels once; True when they are registered.

    Every op wrapper calls this before ``torch.ops.mpnb.<name>`` until it returned True once;
    after that the wrappers read one list element. When the kernels cannot be built the
    references run (one warning).
    """
    if _loaded[0]:
        return True
    ok = cpu_extension().available()
    _loaded[0] = ok
    return ok


def kernels_loaded() -> bool:
    """True when the C++ kernels are loaded in this process (never builds or loads them)."""
    status = cpu_extension().status()
    return bool(status is not None and status.loaded)


@contextlib.contextmanager
def use_reference(names: Iterable[str] | None = None) -> Iterator[None]:
    """Run the pure-PyTorch references on the CPU inside the block, kernels or not.

    The references are registered for the CPU key in a temporary ``torch.library`` fragment
    that overrides the C++ kernels; leaving the block (also by an exception) destroys it and
    the C++ kernels are the CPU's kernels again. Tests use it to run a whole training step
    on the references; users can use it to check a suspected kernel bug.

    Args:
        names: the ops to switch (default: every op).

    Example::

        >>> with use_reference():
        ...     amp_step()          # every mpnb op runs its reference
    """
    ensure_kernels()  # load first: a later load would override the references again
    ops = all_ops() if names is None else [op_info(n) for n in names]
    lib = torch.library.Library("mpnb", "IMPL")
    switched = {op.name for op in ops} - _REFERENCE_ON_CPU
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered")
            for op in ops:
                lib.impl(op.name, op.reference_kernel, "CPU")
        _REFERENCE_ON_CPU.update(switched)
        yield
    finally:
        lib._destroy()
        _REFERENCE_ON_CPU.difference_update(switched)


@contextlib.contextmanager
def use_torch_path(names: Iterable[str] | None = None) -> Iterator[None]:
    """Run, on the CPU inside the block, what CUDA runs when no Triton kernel is on: each op's
    PyTorch-ops path (``cuda=``), else its reference.

    Tests use it to check, without a GPU, what a CUDA step does that the C++ kernels do not
    (its host reads, its numerics); PyTorch's fused ops it calls have CPU kernels too.

    Args:
        names: the ops to switch (default: every op).

    Example::

        >>> with use_torch_path():
        ...     amp_step()          # torch._fused_adamw_ where CUDA would call it
    """
    ensure_kernels()
    ops = all_ops() if names is None else [op_info(n) for n in names]
    lib = torch.library.Library("mpnb", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered")
            for op in ops:
                lib.impl(op.name, op.torch_path or op.reference_kernel, "CPU")
        yield
    finally:
        lib._destroy()


def op_path(name: str, device: str = "cpu") -> str:
    """Which implementation a call of ``mpnb::name`` on ``device`` takes now, in words.

    Read off the dispatcher: a kernel registered for the device's key is ours (or
    PyTorch's ops on CUDA); otherwise the reference runs.
    """
    op = op_info(name)
    dev = torch.device(device).type
    ext = cpu_extension()
    if dev == "cuda":
        if name in _TRITON_ON_CUDA:
            return f"Triton kernel ({_triton.decision(name).label})"
        opt_in = f" (Triton kernel {_triton.decision(name).label})" if op.triton else ""
        if op.cuda is not None:
            return "PyTorch's fused CUDA ops" + opt_in
        return "reference (PyTorch ops, no CUDA kernel)" + opt_in
    if dev != "cpu":
        return f"reference (no {dev} kernel)"
    if name in _REFERENCE_ON_CPU:
        return "reference (inside use_reference())"
    if not op.cpu_kernel:
        return "reference (no C++ kernel for this op)"
    if ext.disabled:
        return "reference (MPNB_DISABLE_EXT=1)"
    status = ext.status()
    if status is None:
        built = ext.is_built()
        return "C++ kernel (built, not loaded yet)" if built else "C++ kernel (built on first use)"
    if not status.loaded:
        return f"reference (build failed: {status.reason.splitlines()[0][:80]})"
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.qualname, "CPU"):
        return "C++ kernel (cpu)"
    return "reference (the library has no CPU kernel for this op)"
