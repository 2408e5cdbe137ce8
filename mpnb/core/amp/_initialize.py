"""``amp.initialize``: resolve the properties, cast the models, attach hooks, make scalers."""

from __future__ import annotations

import warnings

import torch

from mpnb.core.amp._model import AutocastForward, CastForward, cast_model, model_device
from mpnb.core.amp._optimizer import OptimizerAmp
from mpnb.core.amp._properties import Properties, format_properties, resolve_properties
from mpnb.core.amp.casts import default_registry
from mpnb.core.amp.frontend import registry
from mpnb.core.amp.handle import AmpHandle
from mpnb.core.amp.scaler import LossScaler
from mpnb.core.hardware import cuda_info, half_support

__all__ = ["initialize", "EmulatedHalfWarning", "HardwareCheck"]


class EmulatedHalfWarning(UserWarning):
    """A half dtype runs emulated (in software) on this device: correct, but slow."""


class HardwareCheck:
    """Say honestly what the device does with the half dtype: warn once, or refuse."""

    def __init__(self) -> None:
        self.warned: set[tuple[str, torch.dtype]] = set()

    def __call__(self, device: torch.device, dtype: torch.dtype) -> None:
        """Warn (once per device type and dtype) when emulated; raise when unsupported."""
        name = "float16" if dtype == torch.float16 else "bfloat16"
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
            warnings.warn(
                "amp: this CPU has no native float16 (no avx512_fp16/amx_fp16): fp16 is emulated "
                "in software and far slower than fp32 (matmuls ~50-150x). Use "
                "half_dtype=torch.bfloat16 (the CPU default) unless you need fp16 numerics.",
                EmulatedHalfWarning,
                stacklevel=3,
            )


hardware_check = HardwareCheck()


def _as_list(obj, kind: type, what: str) -> tuple[list, bool]:
    was_list = isinstance(obj, (list, tuple))
    items = list(obj) if was_list else [obj]
    for x in items:
        if not isinstance(x, kind):
            raise TypeError(
                f"amp.initialize: {what} must be a {kind.__module__}.{kind.__name__} "
                f"or a list of them, got {type(x).__name__}."
            )
    return items, was_list


def _attach_model(model: torch.nn.Module, props: Properties, states: list[OptimizerAmp]) -> list:
    hooks = []
    if props.cast_model_type is not None:
        out = props.cast_model_outputs or torch.float32
        hooks += CastForward(props.cast_model_type, out).attach(model)
    if props.patch_torch_functions:
        dev = model_device(model).type
        hooks += AutocastForward(
            dev, props.half_dtype, default_registry, props.cast_model_outputs
        ).attach(model)
    elif props.cast_model_type is None and props.cast_model_outputs is not None:
        hooks += CastForward(None, props.cast_model_outputs).attach(model)

    def refresh(module, incompatible):  # model.load_state_dict after initialize: re-read masters
        for st in states:
            st.refresh_masters_from_model()

    hooks.append(model.register_load_state_dict_post_hook(refresh))
    return hooks


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
    max_loss_scale=2.0**24,
    half_dtype=None,
):
    """Set up mixed precision for ``models`` and ``optimizers`` (Apex's ``amp.initialize``).

    Args:
        models: a ``torch.nn.Module`` or a list of them.
        optimizers: a ``torch.optim.Optimizer``, a list, or None.
        opt_level: ``"O0"`` fp32, ``"O1"`` autocast, ``"O2"`` half model + fp32 masters,
            ``"O3"`` pure half.
        half_dtype: ``torch.float16`` or ``torch.bfloat16`` (default fp16 on CUDA, bf16 on CPU).
        num_losses: how many loss scalers (``loss_id`` of ``scale_loss``).
        verbosity: 1 prints the chosen properties, 0 is silent.
        The other arguments override the opt level's defaults as in Apex.

    Returns:
        ``models`` (same shape as given) if ``optimizers`` is None, else
        ``(models, optimizers)``; the objects are the ones passed in.

    Example::

        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    """
    model_list, models_was_list = _as_list(models, torch.nn.Module, "models")
    opt_list, opts_was_list = (
        ([], False)
        if optimizers is None
        else _as_list(optimizers, torch.optim.Optimizer, "optimizers")
    )
    if not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"amp.initialize: num_losses must be a positive int, got {num_losses!r}.")
    for m in model_list:
        if m in registry.models:
            raise ValueError(
                "amp.initialize: this model was already initialized; call "
                "amp.initialize once per model (build a fresh model to change level)."
            )
    for o in opt_list:
        if o in registry.optimizers:
            raise ValueError(
                "amp.initialize: this optimizer was already initialized; pass it once."
            )
    device = model_device(model_list[0]) if model_list else torch.device("cpu")
    props = resolve_properties(
        opt_level,
        device,
        enabled=enabled,
        cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights,
        loss_scale=loss_scale,
        cast_model_outputs=cast_model_outputs,
        half_dtype=half_dtype,
    )
    if verbosity:
        print(format_properties(props))
    handle = _build(props, model_list, opt_list, device, num_losses, min_loss_scale, max_loss_scale)
    registry.latest = handle
    models_out = model_list if models_was_list else model_list[0]
    if optimizers is None:
        return models_out
    return models_out, (opt_list if opts_was_list else opt_list[0])


def _build(props, model_list, opt_list, device, num_losses, min_loss_scale, max_loss_scale):
    uses_half = props.patch_torch_functions or props.cast_model_type in (
        torch.float16,
        torch.bfloat16,
    )
    if props.enabled and uses_half:
        hardware_check(device, props.half_dtype)
    if props.enabled and props.cast_model_type is not None:
        keep_bn = props.cast_model_type != torch.float32 and bool(props.keep_batchnorm_fp32)
        for m in model_list:  # before the optimizers: masters are made from the cast params
            cast_model(m, props.cast_model_type, keep_bn)
    states = [OptimizerAmp(o, props.master_weights) for o in opt_list] if props.enabled else []
    hooks = []
    if props.enabled:
        for m in model_list:
            hooks += _attach_model(m, props, states)
    scalers = [
        LossScaler(
            props.loss_scale,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            device=device,
        )
        for _ in range(num_losses)
    ]
    handle = AmpHandle(props, scalers, states, hooks)
    for i, o in enumerate(opt_list):
        registry.optimizers[o] = states[i] if states else None
        registry.handles[o] = handle
    for m in model_list:
        registry.models.add(m)
    return handle
