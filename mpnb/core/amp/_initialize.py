"""``amp.initialize``: resolve the properties, cast the models, attach hooks, make scalers."""

from __future__ import annotations

import warnings

import torch

from mpnb.core.amp._model import (
    AutocastForward,
    CastForward,
    cast_model,
    check_fp32,
    check_model,
    check_not_sharded,
    model_device,
)
from mpnb.core.amp._properties import Properties, format_properties, resolve_properties
from mpnb.core.amp._rule import LossScaleRule
from mpnb.core.amp._state import AmpOptimizerState, AmpStash
from mpnb.core.amp._strategies import choose_strategy
from mpnb.core.amp.casts import default_registry
from mpnb.core.amp.frontend import set_current_handle
from mpnb.core.amp.handle import AmpHandle, Fp32StateDict
from mpnb.core.amp.scaler import LossScaler
from mpnb.core.amp.seam import amp_stash, bind, inner_optimizer
from mpnb.core.dtype_names import torch_name
from mpnb.core.hardware import cuda_info, dtype_support, half_support

__all__ = ["initialize", "EmulatedHalfWarning", "PrecisionRecastWarning", "HardwareCheck"]

_HALF = (torch.float16, torch.bfloat16)
_MODEL_MARK = "_amp_initialized"  # set on each model amp.initialize took (documented below)


class EmulatedHalfWarning(UserWarning):
    """A half dtype runs emulated (in software) on this device: correct, but slow."""


class PrecisionRecastWarning(UserWarning):
    """amp cast a model that was not fp32 (float64 -> bf16, ...) to the half dtype.

    (A model already in fp16/bf16 is refused instead, as Apex refuses it; see
    :func:`~mpnb.core.amp._model.check_fp32`.)
    """


class HardwareCheck:
    """Say honestly what the device does with the half dtype: warn once, or refuse.

    One instance per ``amp.initialize`` (it belongs to that call's handle).
    """

    def __init__(self) -> None:
        self.warned: set[tuple[str, torch.dtype]] = set()

    def __call__(self, device: torch.device, dtype: torch.dtype) -> None:
        """Warn (once per device type and dtype) when emulated; raise when unsupported."""
        name = torch_name(dtype)
        status = half_support(device)[name]
        if status == "unsupported":
            info = cuda_info(device.index or 0) if device.type == "cuda" else None
            why = (
                f"{info['name']} has compute capability {info['capability']}; bf16 needs 8.0+"
                if info
                else f"{device} has no {name} support"
            )
            raise ValueError(
                f"amp.initialize: half_dtype=torch.{name} is not supported: {why}. "
                "Use half_dtype=torch.float16 (or opt_level='O0')."
            )
        key = (device.type, dtype)
        if status == "emulated" and dtype == torch.float16 and key not in self.warned:
            self.warned.add(key)
            measured = dtype_support(device)[name].reason
            warnings.warn(
                f"amp: float16 is emulated on this CPU ({measured}): computed in software, "
                "far slower than fp32. Use "
                "half_dtype=torch.bfloat16 (the CPU default) unless you need fp16 numerics.",
                EmulatedHalfWarning,
                stacklevel=4,
            )


def _as_list(obj, kind: type, what: str) -> tuple[list, bool]:
    was_list = isinstance(obj, (list, tuple))
    items = list(obj) if was_list else [obj]
    for x in items:
        if kind is torch.optim.Optimizer and inner_optimizer(x) is not None:
            continue
        if not isinstance(x, kind):
            raise TypeError(
                f"amp.initialize: {what} must be a {kind.__module__}.{kind.__name__} "
                f"or a list of them, got {type(x).__name__}."
            )
    return items, was_list


def _bounded(rule: LossScaleRule, min_loss_scale, max_loss_scale) -> LossScaleRule:
    """``rule`` with Apex's ``min_loss_scale``/``max_loss_scale`` arguments applied."""
    try:
        return rule.with_bounds(min_loss_scale, max_loss_scale)
    except ValueError as e:
        raise ValueError(str(e).replace("LossScaleRule", "amp.initialize", 1)) from None


def initialize(
    models,
    optimizers=None,
    enabled=True,
    opt_level="O1",
    cast_model_type=None,
    patch_torch_functions=None,
    keep_batchnorm_fp32=None,
    master_weights=None,
    loss_scale=None,
    cast_model_outputs=None,
    num_losses=1,
    verbosity=1,
    min_loss_scale=None,
    max_loss_scale=None,
    half_dtype=None,
):
    """Set up mixed precision for ``models`` and ``optimizers`` (Apex's ``amp.initialize``).

    The arguments after ``opt_level`` override the opt level's defaults, as in Apex.

    Args:
        models: a ``torch.nn.Module`` or a list of them, in fp32: a model with fp16/bf16
            params or buffers is refused at every opt level, as in Apex (amp makes the half
            copies itself); ``cast_model_type=False`` keeps a model's dtypes on purpose.
        optimizers: a ``torch.optim.Optimizer``, a list, or None. An optimizer wrapped in
            :class:`~mpnb.parallel.LARC` is accepted as in Apex (amp serves the optimizer
            inside; the wrapper's ``step()`` rescales the unscaled grads, then steps it).
        opt_level: ``"O0"`` fp32, ``"O1"`` autocast, ``"O2"`` half model + fp32 masters,
            ``"O3"`` pure half.
        half_dtype: ``torch.float16``/``torch.bfloat16`` or a name (``"bf16"``, ``"fp16"``,
            ...; default fp16 on CUDA, bf16 on CPU; with ``cast_model_type=False``, the half
            dtype the model's params already have, when they have one).
        loss_scale: the scalers' rule. ``"dynamic"`` (the default
            :class:`~mpnb.core.amp.LossScaleRule`), a positive finite number (a static scale:
            steps are never skipped, as in Apex), a :class:`~mpnb.core.amp.LossScaleRule`, or a
            dict of its fields (GradScaler's names: ``dict(init_scale=2**24,
            backoff_factor=0.125, growth_interval=100)``). None: the opt level's default
            (dynamic for O1/O2, static 1.0 for O0/O3).
        min_loss_scale, max_loss_scale: the dynamic scale's bounds (Apex's arguments; the
            rule's fields). Default: no minimum, 2**24.
        cast_model_outputs: dtype the model's floating outputs are cast to. Default fp32 at
            every level, so a loss computed from them is fp32 (under O1 this is Apex's fp32
            loss numerics); ``False`` leaves the outputs as the model made them. Tuples,
            namedtuples, dicts, dataclasses and ``ModelOutput`` keep their type.
        num_losses: how many loss scalers (``loss_id`` of ``scale_loss``).
        verbosity: 1 prints the chosen properties, 0 is silent.

    Returns:
        ``models`` (same shape as given) if ``optimizers`` is None, else
        ``(models, optimizers)``; the objects are the ones passed in. Each optimizer gets a
        read-only ``optimizer._amp_stash`` (Apex's name; see
        :class:`~mpnb.core.amp._state.AmpStash`) and each model an ``_amp_initialized = True``
        mark; the latest call's handle is :func:`~mpnb.core.amp.current_handle`.

    Example::

        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0,
        ...                                   loss_scale=dict(backoff_factor=0.25))
    """
    model_list, models_was_list = _as_list(models, torch.nn.Module, "models")
    opt_list, opts_was_list = (
        ([], False)
        if optimizers is None
        else _as_list(optimizers, torch.optim.Optimizer, "optimizers")
    )
    if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"amp.initialize: num_losses must be a positive int, got {num_losses!r}.")
    for m in model_list:
        if getattr(m, _MODEL_MARK, False):
            raise ValueError(
                "amp.initialize: this model was already initialized; call "
                "amp.initialize once per model (build a fresh model to change level)."
            )
    for o in opt_list:
        if amp_stash(o) is not None:
            raise ValueError(
                "amp.initialize: this optimizer was already initialized; pass it once."
            )
    if enabled:  # up front: before anything is cast or bound
        for m in model_list:
            check_not_sharded(m, str(opt_level))
    device = model_device(model_list[0]) if model_list else torch.device("cpu")
    keep_dtypes = cast_model_type is False or cast_model_type == "False"
    if half_dtype is None and keep_dtypes:
        half_dtype = _models_half_dtype(model_list)  # the half dtype the model already has
    # The one parse of loss_scale; the rule travels unchanged to the scalers.
    rule = LossScaleRule.parse(loss_scale, owner="amp.initialize")
    props = resolve_properties(
        opt_level,
        device,
        enabled=enabled,
        cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights,
        loss_scale=rule,
        cast_model_outputs=cast_model_outputs,
        half_dtype=half_dtype,
    )
    # No loss_scale given: the opt level's default, which Properties spells as Apex does.
    rule = _bounded(rule or LossScaleRule.parse(props.loss_scale), min_loss_scale, max_loss_scale)
    bindings = [None] * len(opt_list)
    if props.enabled:
        for m in model_list:
            check_model(m)
            if not keep_dtypes:  # cast_model_type=False: the caller keeps half on purpose
                check_fp32(m, props.opt_level)
        # amp binds each optimizer (the inner one of a LARC) once, before the model changes
        bindings = [bind(inner_optimizer(o) or o, props.master_weights) for o in opt_list]
    if verbosity:
        print(format_properties(props))
    optimizers_bound = list(zip(opt_list, bindings, strict=True))
    handle = _build(props, rule, model_list, optimizers_bound, device, num_losses)
    set_current_handle(handle)
    models_out = model_list if models_was_list else model_list[0]
    if optimizers is None:
        return models_out
    return models_out, (opt_list if opts_was_list else opt_list[0])


def _models_half_dtype(models: list) -> torch.dtype | None:
    """The one half dtype among the models' params (None: none, or both fp16 and bf16)."""
    found = {p.dtype for m in models for p in m.parameters() if p.dtype in _HALF}
    return found.pop() if len(found) == 1 else None


def _uses_half(props: Properties) -> bool:
    return props.patch_torch_functions or props.cast_model_type in _HALF


def _build(props, rule, model_list, optimizers, device, num_losses) -> AmpHandle:
    """The handle: scalers, cast models, and each ``(optimizer, binding)`` served by amp."""
    half = props.half_dtype if props.enabled and _uses_half(props) else None
    scalers = [LossScaler(rule, device=device, half_dtype=half) for _ in range(num_losses)]
    handle = AmpHandle(props, scalers)
    if half is not None:
        HardwareCheck()(device, half)
    if props.enabled and props.cast_model_type is not None:
        keep_bn = props.cast_model_type != torch.float32 and bool(props.keep_batchnorm_fp32)
        recast: set[torch.dtype] = set()
        for m in model_list:  # before the optimizers: masters are made from the cast params
            recast |= cast_model(m, props.cast_model_type, keep_bn)
        if recast and props.cast_model_type in _HALF:
            names = ", ".join(sorted(str(d).split(".")[-1] for d in recast))
            warnings.warn(
                f"amp.initialize: the model had {names} params; opt_level={props.opt_level!r} "
                f"cast them to {props.cast_model_type} (a lossy recast, not from fp32). Start "
                "from an fp32 model (model.float()).",
                PrecisionRecastWarning,
                stacklevel=3,
            )
    for o, binding in optimizers:
        st = None
        inner = inner_optimizer(o) or o  # LARC: amp's hooks go on the optimizer it wraps
        if props.enabled:
            strategy = choose_strategy(inner, props.master_weights, binding)
            st = AmpOptimizerState(inner, strategy, handle)
            handle.opt_states.append(st)
        o._amp_stash = AmpStash(st, handle)
        o._lazy_init_maybe_master_weights = o._amp_stash.lazy_init_maybe_master_weights  # Apex's
        if inner is not o:
            inner._amp_stash = o._amp_stash
    for m in model_list:
        handle.hooks += _attach_model(m, props, handle)
        setattr(m, _MODEL_MARK, True)
    return handle


def _attach_model(model: torch.nn.Module, props: Properties, handle: AmpHandle) -> list:
    out = props.cast_model_outputs
    hooks = []
    if not props.enabled:
        pass
    elif props.cast_model_type is not None:
        hooks += CastForward(props.cast_model_type, out).attach(model)
    if props.patch_torch_functions:
        dev = model_device(model).type
        casts = AutocastForward(dev, props.half_dtype, default_registry.copy(), out).attach(model)
        handle.cast_hooks += casts  # what handle._deactivate() takes off
        hooks += casts
    elif props.cast_model_type is None and out is not None:
        hooks += CastForward(None, out).attach(model)
    if props.enabled and props.cast_model_type in _HALF:  # Apex's fp32 checkpoint format
        hooks.append(model.register_state_dict_post_hook(Fp32StateDict()))
    # model.load_state_dict after initialize: the fp32 masters follow (and keep the handle).
    hooks.append(model.register_load_state_dict_pre_hook(handle.model_load_pre))
    hooks.append(model.register_load_state_dict_post_hook(handle.model_load_post))
    return hooks
