"""``amp.init()``: Apex's older amp API, whose handle casts inputs function by function.

Apex kept this API beside ``amp.initialize``: ``handle = amp.init()`` makes every matmul and
convolution run on fp16 inputs, the functions whose range fp16 lacks (softmax, exp, pow,
sum, the losses, ...) on fp32 inputs, functions of several tensors on the widest of their
dtypes when fp16 and fp32 meet, the recurrent kernels on fp16, refuses in-place fp32-only
methods on fp16 tensors and ``binary_cross_entropy`` on fp16 inputs; ``handle._deactivate()``
ends it. The lists are :mod:`mpnb.core.amp._init_lists`.

**How, without patching torch.** Apex replaced about 150 attributes of ``torch``,
``torch.Tensor`` and ``torch.nn.functional`` with wrappers. mpnb replaces none: the handle
enters a :class:`torch.overrides.TorchFunctionMode`, a public PyTorch mechanism by which every
torch function, ``torch.nn.functional`` function and Tensor method called in this thread is
first handed to the mode's ``__torch_function__`` (the function object, its arguments). The
mode looks the function object up in a table built from Apex's lists, applies that function's
rule to the arguments (a cast, a promotion, a refusal) and calls the function; a function
without a rule is called unchanged. One more public hook serves the recurrent layers: a
global module forward pre-hook (``register_module_forward_pre_hook``) hands an fp16 input to
an ``nn.RNN``/``LSTM``/``GRU`` with fp32 weights in their dtype, since PyTorch checks that
they match before the recurrent kernel (cast to fp16 by its rule) is reached.
``_deactivate()`` takes the mode off PyTorch's mode stack and removes that hook, after which
torch behaves exactly as before; ``with amp.init() as handle:`` does the same on exit, also
when the body raises. ``handle._disable_casts()`` (and ``amp.disable_casts()``)
switch the rules off for a block.

What differs from Apex, on purpose:

* Apex's patches were process-wide; the mode is entered in the calling thread (PyTorch's mode
  stack is per thread), so call ``amp.init`` in the thread that trains.
* Apex cast CUDA tensors only; mpnb casts on every device (CPU included).
* A torch function that PyTorch implements in Python (``F.multi_head_attention_forward``) is
  one call for the mode: its arguments get its rule (none, for that one), the calls it makes
  inside are not seen. Apex's patches also reached those inner calls.
* User functions registered with ``amp.register_*_function`` get their rule when they are
  torch functions (``torch``, ``torch.Tensor``, ``torch.nn.functional``); other functions do
  not pass through the mode (decorate them with ``amp.half_function`` and run them under
  ``amp.initialize``'s O1 instead).
* The cast cache (fp32 ``nn.Parameter`` -> its fp16 copy, reused by every function of one
  forward, as Apex's) also drops an entry when the parameter changes in place (an optimizer
  step) or when backward has gone through the cast, so a stale or freed copy is never reused.

Example::

    >>> handle = amp.init()
    >>> torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype      # a matmul: fp16
    torch.float16
    >>> torch.randn(3, dtype=torch.half).sum().dtype         # a reduction: fp32
    torch.float32
    >>> handle._deactivate()
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.overrides import _get_current_function_mode_stack

from mpnb.core.amp import _init_lists as L
from mpnb.core.amp._config import parse_half_dtype
from mpnb.core.amp.casts import HandleCastMode, default_registry

__all__ = ["init", "InitHandle", "NoOpHandle"]


def _floating(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _is_fp(x) -> bool:
    """A floating tensor, or a list/tuple of nothing but floating tensors (Apex's rule)."""
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return len(x) > 0 and all(_is_fp(y) for y in x)
    return _floating(x)


def _dtypes(args, kwargs) -> set[torch.dtype]:
    out: set[torch.dtype] = set()
    for x in itertools.chain(args, kwargs.values()):
        if _is_fp(x):
            for t in x if isinstance(x, (list, tuple)) else (x,):
                out.add(t.dtype)
    return out


class InitHandle:
    """The handle ``amp.init()`` returns: its casts are active until :meth:`_deactivate`.

    Args:
        enable_caching: reuse one fp16 copy of each fp32 ``nn.Parameter`` (Apex's cache).
        verbose: print each cast (``Float->Half (linear)``), as Apex did.
        allow_banned: run ``binary_cross_entropy`` in fp32 instead of refusing fp16 inputs.
        half_dtype: the dtype of the "half" casts (fp16 as in Apex; bf16 also works).
        loss_scale: kept for Apex's signature; this API never scaled losses in mpnb (use
            ``amp.initialize`` and ``amp.scale_loss``).

    Example::

        >>> with amp.init() as handle:
        ...     y = model(x)              # matmuls fp16, softmax/losses fp32
        >>> handle.is_active()
        False
    """

    def __init__(
        self,
        enable_caching: bool = True,
        verbose: bool = False,
        allow_banned: bool = False,
        half_dtype=torch.float16,
        loss_scale="dynamic",
    ) -> None:
        self.half_dtype = parse_half_dtype(half_dtype, name="amp.init: half_dtype")
        self.loss_scale = loss_scale
        self._enable_caching = bool(enable_caching)
        self._verbose = bool(verbose)
        self._cache: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._is_active = True
        self._table = _build_table(bool(allow_banned))
        self._mode: _CastMode | None = _CastMode(self)
        self._mode.__enter__()
        self._rnn_hook = register_module_forward_pre_hook(self._rnn_inputs)

    # ---- Apex's handle interface ---------------------------------------------------------

    def is_active(self) -> bool:
        """True while the casts apply (entered, not deactivated, not in ``_disable_casts``)."""
        return self._is_active and self._mode is not None

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        """Turn the casts off for the body (restored on exit, also when it raises)."""
        was, self._is_active = self._is_active, False
        try:
            yield
        finally:
            self._is_active = was

    def _deactivate(self) -> None:
        """End the casts: take the mode off PyTorch's mode stack and drop the cast cache.

        Raises:
            RuntimeError: another torch function mode entered after ``amp.init`` is still
                active above it, or this is not the thread that called ``amp.init``.
        """
        mode = self._mode
        if mode is None:
            return
        stack = _get_current_function_mode_stack()
        if mode not in stack:
            raise RuntimeError(
                "amp.init's handle._deactivate(): its casts are not active in this thread; "
                "call _deactivate() in the thread that called amp.init()."
            )
        if stack[-1] is not mode:
            raise RuntimeError(
                f"amp.init's handle._deactivate(): {type(stack[-1]).__name__}, a torch function "
                "mode entered after amp.init(), is still active; leave its with-block first, "
                "then call _deactivate()."
            )
        mode.__exit__(None, None, None)
        self._rnn_hook.remove()
        self._mode = None
        self._cache.clear()

    def __enter__(self) -> InitHandle:
        return self

    def __exit__(self, *exc) -> None:
        self._deactivate()

    def _clear_cache(self) -> None:
        """Forget every cached fp16 copy."""
        self._cache.clear()

    @property
    def has_cache(self) -> bool:
        """Whether fp16 copies of fp32 parameters are cached (``enable_caching``)."""
        return self._enable_caching

    @property
    def cache(self) -> dict:
        """The cache: ``id(param) -> (param, param version, fp16 copy)``."""
        return self._cache

    def remove_cache(self, param: torch.Tensor) -> None:
        """Forget the cached copy of ``param``."""
        self._cache.pop(id(param), None)

    @property
    def verbose(self) -> bool:
        """Whether each cast is printed."""
        return self._verbose

    def scale_loss(self, *args, **kwargs):
        """Not available: loss scaling belongs to ``amp.initialize`` (as in Apex)."""
        _no_loss_scaling("scale_loss")

    def wrap_optimizer(self, *args, **kwargs):
        """Not available: optimizers are served by ``amp.initialize`` (as in Apex)."""
        _no_loss_scaling("wrap_optimizer")

    # ---- casts ---------------------------------------------------------------------------

    def _cast(self, x, dtype: torch.dtype, name: str, cache: bool = False):
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return type(x)(self._cast(y, dtype, name, cache) for y in x)
        if not _floating(x) or x.dtype == dtype:
            return x
        if cache and self._enable_caching and isinstance(x, torch.nn.Parameter):
            if x.dtype == torch.float32:
                return self._cached(x, dtype, name)
        if self._verbose:
            print(f"{_label(x.dtype)}->{_label(dtype)} ({name})")
        return x.to(dtype)

    def _cached(self, x: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
        hit = self._cache.get(id(x))
        if hit is not None and hit[0] is x and hit[1] == x._version:
            cast = hit[2]
            # A copy made under no_grad (evaluation) does not lead back to the param: training
            # must not reuse it (Apex's rule); evaluation may reuse either kind.
            if not (torch.is_grad_enabled() and x.requires_grad != cast.requires_grad):
                return cast
        if self._verbose:
            print(f"{_label(x.dtype)}->{_label(dtype)} ({name})")
        cast = x.to(dtype)
        self._cache[id(x)] = (x, x._version, cast)
        if cast.requires_grad:
            cast.register_hook(_Forget(self._cache, id(x), cast))
        return cast

    def _rnn_inputs(self, module, args):
        """Global forward pre-hook: an fp16 input to a recurrent layer with fp32 weights.

        PyTorch's ``RNNBase`` refuses an input whose dtype differs from its weights' outside
        autocast, before its recurrent kernel (which this handle casts to half) is reached.
        The input is handed over in the weights' dtype instead: the kernel's rule casts it
        back to half (exactly), and its grad still flows to the caller's tensor.
        """
        if not isinstance(module, torch.nn.RNNBase) or not self.is_active():
            return None
        if self._mode not in _get_current_function_mode_stack():  # another thread's forward
            return None
        dtype = module._flat_weights[0].dtype if module._flat_weights else None
        if dtype is None or not args:
            return None
        first = args[0]
        if isinstance(first, torch.nn.utils.rnn.PackedSequence):
            first = first._replace(data=_to(first.data, dtype))
        else:
            first = _to(first, dtype)
        return (first, *(_to(a, dtype) for a in args[1:]))

    def _args(self, args, kwargs, dtype, name, cache=False):
        args = [self._cast(a, dtype, name, cache) if _is_fp(a) else a for a in args]
        kwargs = {
            k: self._cast(v, dtype, name, cache) if _is_fp(v) else v for k, v in kwargs.items()
        }
        return args, kwargs


def _no_loss_scaling(method: str):
    """The old API's loss scaling, refused whatever the arguments (Apex removed it too)."""
    raise RuntimeError(
        f"amp.init's handle.{method}(): the old amp API does not scale losses or wrap "
        "optimizers (Apex removed its old scale_loss and wrap_optimizer too); use "
        "`model, optimizer = amp.initialize(model, optimizer, opt_level='O1')` and "
        "`with amp.scale_loss(loss, optimizer) as scaled: scaled.backward()`."
    )


class _Forget:
    """Backward hook of a cached copy: once backward went through it, its graph is spent."""

    def __init__(self, cache: dict, key: int, cast: torch.Tensor) -> None:
        self.cache, self.key, self.cast = cache, key, weakref.ref(cast)

    def __call__(self, grad):
        hit = self.cache.get(self.key)
        if hit is not None and hit[2] is self.cast():
            del self.cache[self.key]


def _to(x, dtype: torch.dtype):
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_to(y, dtype) for y in x)
    return x.to(dtype) if _floating(x) else x


def _label(dtype: torch.dtype) -> str:
    return {torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float"}.get(
        dtype, str(dtype).split(".")[-1]
    )


class NoOpHandle:
    """``amp.init(enabled=False)``: Apex's handle that casts nothing."""

    def is_active(self) -> bool:
        """Always False."""
        return False

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        """Nothing to disable."""
        yield

    def _deactivate(self) -> None:
        """Nothing to undo."""

    def _clear_cache(self) -> None:
        """No cache."""

    def scale_loss(self, *args, **kwargs):
        """Not available, as on an enabled handle: loss scaling is ``amp.initialize``'s."""
        _no_loss_scaling("scale_loss")

    def wrap_optimizer(self, *args, **kwargs):
        """Not available, as on an enabled handle: optimizers are ``amp.initialize``'s."""
        _no_loss_scaling("wrap_optimizer")

    has_cache = property(lambda self: False, doc="Always False.")
    verbose = property(lambda self: False, doc="Always False.")

    def __enter__(self) -> NoOpHandle:
        return self

    def __exit__(self, *exc) -> None:
        return None


# ---- the rules: (handle, func, name, args, kwargs) -> result ---------------------------------


def _half(h, func, name, args, kwargs):
    args, kwargs = h._args(args, kwargs, h.half_dtype, name, cache=True)
    return func(*args, **kwargs)


def _float(h, func, name, args, kwargs):
    args, kwargs = h._args(args, kwargs, torch.float32, name)
    return func(*args, **kwargs)


def _promote(h, func, name, args, kwargs):
    if _dtypes(args, kwargs) == {h.half_dtype, torch.float32}:
        args, kwargs = h._args(args, kwargs, torch.float32, name)
    return func(*args, **kwargs)


def _sequence(h, func, name, args, kwargs):
    seq, rest = args[0], args[1:]
    if isinstance(seq, (list, tuple)) and _dtypes([seq], {}) == {h.half_dtype, torch.float32}:
        seq = [h._cast(t, torch.float32, name) for t in seq]
    return func(seq, *rest, **kwargs)


def _match_self(h, func, name, args, kwargs):
    head = args[0]
    if _floating(head) and head.dtype in (h.half_dtype, torch.float32):
        rest, kwargs = h._args(args[1:], kwargs, head.dtype, name)
        args = (head, *rest)
    return func(*args, **kwargs)


def _refuse_half_self(h, func, name, args, kwargs):
    if _floating(args[0]) and args[0].dtype == h.half_dtype:
        raise NotImplementedError(
            f"amp.init: in-place {name} on an fp16 tensor: amp runs {name[:-1]} in fp32 only. "
            f"Use the out-of-place x.{name[:-1]}() (amp returns fp32), or x.float() first."
        )
    rest, kwargs = h._args(args[1:], kwargs, torch.float32, name)
    return func(args[0], *rest, **kwargs)


def _refuse_any_half(h, func, name, args, kwargs, message=None):
    if h.half_dtype in _dtypes(args, kwargs):
        raise NotImplementedError(
            message
            or f"amp.init: in-place torch.{name} with fp16 arguments: amp runs it in fp32 only. "
            f"Use the out-of-place torch.{name[:-1]} (amp returns fp32)."
        )
    return func(*args, **kwargs)


def _banned(h, func, name, args, kwargs):
    return _refuse_any_half(h, func, name, args, kwargs, L.BANNED[name])


def _rnn(h, func, name, args, kwargs):
    args, kwargs = h._args(args, kwargs, h.half_dtype, name)
    return func(*args, **kwargs)


_POLICY = {"half": _half, "float": _float, "promote": _promote}


def _build_table(allow_banned: bool) -> dict[Callable, tuple[Callable, str]]:
    """Function object -> (rule, name), from Apex's lists and the user's registrations."""
    table: dict = {}

    def put(owner, names, rule, suffix=""):
        for n in names:
            fn = getattr(owner, n + suffix, None)
            if fn is not None and fn not in table:
                table[fn] = (rule, n + suffix)

    T = torch.Tensor
    for _module, name, policy in default_registry.entries.values():  # the user's first
        put(_module, [name], _POLICY[policy])
    put(F, L.FUNCTIONAL_HALF, _half)
    put(F, L.FUNCTIONAL_FLOAT, _float)
    put(F, L.BANNED, _float if allow_banned else _banned)
    for owner in (torch, T):
        put(owner, L.HALF, _half)
        put(owner, L.FLOAT, _float)
        put(owner, L.PROMOTE, _promote)
        put(owner, L.SEQUENCE, _sequence)
    put(T, L.TENSOR_HALF, _half)
    put(T, L.TENSOR_FLOAT, _float)
    put(torch._VF, L.RNNS, _rnn)
    put(torch._VF, L.RNN_CELLS, _half)
    put(T, (*L.FLOAT, "__ipow__"), _refuse_half_self, "_")
    put(torch, L.FLOAT, _refuse_any_half, "_")
    put(T, (*L.HALF, *L.PROMOTE), _match_self, "_")
    return table


class _CastMode(HandleCastMode):
    """The handle's casts: each torch call whose function has a rule goes through it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        h = self.handle
        entry = h._table.get(func) if h._is_active else None
        if entry is None:
            return func(*args, **kwargs)
        rule, name = entry
        return rule(h, func, name, args, kwargs)


def active_handles() -> list[InitHandle]:
    """The ``amp.init`` handles whose casts are on in this thread (innermost last)."""
    return [m.handle for m in _get_current_function_mode_stack() if isinstance(m, _CastMode)]


def init(
    enabled: bool = True,
    loss_scale="dynamic",
    enable_caching: bool = True,
    verbose: bool = False,
    allow_banned: bool = False,
    half_dtype=torch.float16,
):
    """Apex's ``amp.init``: cast per function until the handle's ``_deactivate()``.

    Args:
        enabled: False returns a :class:`NoOpHandle` (nothing changes).
        loss_scale: accepted for Apex's signature (see :class:`InitHandle`).
        enable_caching: cache one fp16 copy of each fp32 parameter (default True).
        verbose: print every cast.
        allow_banned: run ``F.binary_cross_entropy`` in fp32 rather than refuse fp16 inputs.
        half_dtype: the dtype of the half casts (default fp16, Apex's only one).

    Returns:
        An :class:`InitHandle` (or :class:`NoOpHandle`); also a context manager.

    Example::

        >>> handle = amp.init(enabled=True)
        >>> out = model(x)
        >>> handle._deactivate()
    """
    if not enabled:
        return NoOpHandle()
    return InitHandle(enable_caching, verbose, allow_banned, half_dtype, loss_scale)
