"""fp32 masters and loss scales across checkpoints: never dropped or switched silently.

Under O2 the fp32 masters are saved with the optimizer's state: amp's own under
``state_dict()["mpnb_amp_masters"]`` (``{param index: tensor}``, the index being the one of
``state_dict()["state"]``), a fused optimizer's as ``state[i]["master_param"]``. On load,
whatever kind saved them, they go where the loading optimizer keeps its masters: amp's masters
(``torch.optim`` under O2), the fused optimizer's state (``FusedAdam`` under O2), or, under
O0/O1/O3, the fp32 params themselves. Everything is validated in the load pre-hook, before
the optimizer changes anything.

A loss scaler's state follows the same rule the other way round: the run keeps the kind of
scaling ``amp.initialize`` set up. A dynamic checkpoint loaded into a static run (a number
given as ``loss_scale``, or bf16's no scaling) does not make it scale by the checkpoint's
65536, and a static checkpoint does not reset a dynamic run's scale; one
:class:`LossScaleStateWarning` says what was kept (:func:`resolve_scaler_state`).

Without amp (no hooks on the optimizer), mpnb's fused optimizers load an O2 checkpoint's
masters themselves (:mod:`mpnb.core.optimizers._load`); a ``torch.optim`` optimizer cannot:
set the run up with ``amp.initialize(model, optimizer, opt_level="O0")`` before loading and
amp carries the masters into the fp32 params.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Mapping

import torch

from mpnb.core.amp.seam import MASTERS_KEY

__all__ = [
    "MASTERS_KEY",
    "LossScaleStateWarning",
    "flat_params",
    "save_masters",
    "take_masters",
    "apply_masters",
    "resolve_scaler_state",
    "warn_kept_scales",
]

_HALF = (torch.float16, torch.bfloat16)


def flat_params(optimizer) -> list[torch.Tensor]:
    """Every param of ``optimizer`` in ``state_dict()["state"]`` index order."""
    return list(itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups))


def save_masters(strategy, optimizer, state_dict: dict) -> dict:
    """Add amp's own masters to ``state_dict`` (the fused optimizers save theirs in state)."""
    masters = strategy.masters
    if masters is not None and masters.masters:
        pos = {id(p): i for i, p in enumerate(flat_params(optimizer))}
        state_dict[MASTERS_KEY] = {pos[id(m)]: m.detach() for m in masters.masters}
    return state_dict


def _bad(msg: str) -> ValueError:
    return ValueError(
        f"optimizer.load_state_dict: {msg}; load a checkpoint of the same model (amp saved "
        "its fp32 masters with the optimizer state); nothing was changed."
    )


def take_masters(strategy, optimizer, state_dict: dict) -> tuple[dict, dict[int, torch.Tensor]]:
    """Find the saved masters, check them against ``optimizer``, take them out of the state.

    Returns the state dict to load (without masters, unless the optimizer keeps its own in
    its state) and ``{param index: fp32 tensor}``. Raises ValueError, changing nothing, when
    they do not fit.
    """
    params = flat_params(optimizer)
    ids = _amp_master_ids(strategy)
    own = [i for i, p in enumerate(params) if id(p) in ids]
    saved = state_dict.get(MASTERS_KEY)
    found: dict[int, torch.Tensor] = {}
    if isinstance(saved, (list, tuple)):  # the earlier format: amp's masters in order
        if len(saved) != len(own):
            raise _bad(
                f"the state holds {len(saved)} fp32 master params but this optimizer has {len(own)}"
            )
        found = dict(zip(own, saved, strict=True))
    elif isinstance(saved, Mapping):
        found = dict(saved)
    elif saved is not None:
        raise _bad(f"state_dict[{MASTERS_KEY!r}] is a {type(saved).__name__}, not a dict")
    keeps_own = strategy.internal_masters
    state = state_dict.get("state", {})
    for k, v in state.items():
        if isinstance(v, Mapping) and "master_param" in v:
            found[k] = v["master_param"]
    for i, t in found.items():
        if not isinstance(i, int) or not 0 <= i < len(params):
            raise _bad(f"a saved fp32 master belongs to param {i!r}, which does not exist here")
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise _bad(f"the saved fp32 master of param {i} is not a floating tensor")
        if t.numel() != params[i].numel():
            raise _bad(
                f"the saved fp32 master of param {i} has {t.numel()} elements but the param "
                f"has {params[i].numel()}"
            )
    if own and found and set(found) != set(own):
        raise _bad(
            f"the state holds {len(found)} fp32 master params but this optimizer has "
            f"{len(own)} (at other positions)"
        )
    out = dict(state_dict)
    out.pop(MASTERS_KEY, None)
    if not keeps_own and any("master_param" in v for v in state.values() if isinstance(v, dict)):
        out["state"] = {
            k: {n: x for n, x in v.items() if n != "master_param"} if isinstance(v, dict) else v
            for k, v in state.items()
        }
    return out, found


def _amp_master_ids(strategy) -> set[int]:
    masters = strategy.masters
    return set() if masters is None else {id(m) for m in masters.masters}


@torch.no_grad()
def apply_masters(strategy, optimizer, found: dict[int, torch.Tensor]) -> list:
    """Put the checked masters where ``optimizer`` keeps its fp32 values.

    Returns the ``(param, fp32 value)`` pairs written into fp32 params (O0/O1/O3), which a
    model load that follows must not round away.
    """
    if not found:
        return []
    params = flat_params(optimizer)
    ids = _amp_master_ids(strategy)
    carried = []
    for i, t in found.items():
        p = params[i]
        value = t.detach().to(device=p.device, dtype=torch.float32).reshape(p.shape)
        if strategy.internal_masters and p.dtype in _HALF:
            optimizer._mpnb_set_master(p, value)
            p.copy_(value)
        elif p.dtype == torch.float32:
            p.copy_(value)
            if id(p) not in ids:
                carried.append((p, value.clone()))
        else:  # a half param with no master of its own here: it takes the rounded value
            p.copy_(value)
    if strategy.masters is not None:
        strategy.masters.copy_to_model()
    return carried


# ---- loss scalers across configurations -------------------------------------------------------


class LossScaleStateWarning(UserWarning):
    """A checkpoint's loss scale of another kind (dynamic / static) than the run's was not used."""


def resolve_scaler_state(scaler, state, key: str = "state") -> tuple[tuple, str | None]:
    """What ``amp.load_state_dict`` applies to ``scaler``: the checkpoint's state (validated by
    ``scaler.check_state_dict``) when it is of the scaler's kind, else the scaler's own.
    (``LossScaler.load_state_dict`` itself, which Apex's ``_loss_scale`` setter goes through,
    takes what it is given.)

    Returns ``(state for scaler.apply_state, note)``; the note says what was kept (None when
    nothing differs). An Apex entry (no ``"dynamic"`` key: its kind is unknown) is taken as it
    is, as Apex takes it.
    """
    checked = scaler.check_state_dict(state, key)
    saved_dynamic = state.get("dynamic")
    if not isinstance(saved_dynamic, bool):
        return checked, None
    own_scale = scaler.loss_scale()
    saved_scale = float(state["loss_scale"])
    if saved_dynamic == scaler.dynamic and (scaler.dynamic or saved_scale == own_scale):
        return checked, None
    skipped, run, _ = scaler.counters.read()
    own = (
        own_scale,
        int(scaler.growth_tracker.item()),
        int(scaler.hysteresis_tracker.item()),
        run,
        skipped,
    )
    if scaler.dynamic:
        note = (
            f"{key}: the checkpoint's loss scale is static ({saved_scale:g}), this run's is "
            f"dynamic: it keeps its own scale ({own_scale:g}) and grows or backs off from there"
        )
    else:
        unscaled = own_scale == 1.0 and scaler.half_dtype in (torch.bfloat16, None)
        what = "no loss scaling" if unscaled else f"a static scale of {own_scale:g}"
        saved = f"dynamic ({saved_scale:g})" if saved_dynamic else f"static ({saved_scale:g})"
        note = (
            f"{key}: the checkpoint's loss scale is {saved}, this run has {what}, as "
            "amp.initialize set it up; it keeps it"
        )
    return own, note


def warn_kept_scales(notes) -> None:
    """One :class:`LossScaleStateWarning` for every scaler that kept its own state (if any)."""
    notes = [n for n in notes if n]
    if notes:
        warnings.warn(
            f"amp.load_state_dict: {'; '.join(notes)}. The checkpoint's scale and counters "
            "are not used. To resume its scaling, pass amp.initialize(..., loss_scale=...) "
            "as it was saved ('dynamic', or its static number).",
            LossScaleStateWarning,
            stacklevel=3,
        )
