"""What a fused optimizer keeps of a checkpoint beyond its state: its rounding, fp32 masters.

* **Rounding follows the constructor.** ``torch.optim.Optimizer.load_state_dict`` replaces the
  param groups with the saved ones, and with them ``stochastic_rounding`` /
  ``kahan_summation``. The optimizer keeps the rounding it was built with instead; when the
  checkpoint's differs, one :class:`CheckpointRoundingWarning` says so and what happened to
  the Kahan compensation buffers (carried, dropped, or started from zero) and to the
  stochastic rounding's seed.
* **fp32 masters without amp.** An O2 checkpoint holds fp32 master weights, in the state
  (``state[i]["master_param"]``, a fused optimizer's) or beside it (amp's
  ``"mpnb_amp_masters"``, a ``torch.optim`` optimizer's). Under amp, amp's load hooks put them
  where the run keeps its fp32 values. Without amp, a fused optimizer loads them into its fp32
  params (the model's checkpoint holds only their half rounding) and keeps them there if the
  model's half weights are loaded afterwards; its half params take them as their masters
  (``master_weights=True``) or the load is refused, naming ``amp.initialize``.
"""

from __future__ import annotations

import itertools
import warnings

import torch

from mpnb.core.amp.seam import MASTERS_KEY, amp_stash

__all__ = ["CheckpointRoundingWarning", "Rounding", "MastersWithoutAmp"]

_HALF = (torch.float16, torch.bfloat16)
_OPTIONS = ("stochastic_rounding", "kahan_summation")
_NAMES = {None: "round-to-nearest", "stochastic": "stochastic rounding", "kahan": "Kahan summation"}


class CheckpointRoundingWarning(UserWarning):
    """A checkpoint saved with another rounding of bf16 updates than the optimizer's."""


def _flat_ids(groups) -> list:
    return list(itertools.chain.from_iterable(g["params"] for g in groups))


def saved_rounding(state_dict: dict, group: dict) -> str | None:
    """The rounding a saved param group was trained with: its flags, or (a checkpoint of an
    optimizer without them) what its state shows: a compensation buffer, a ``"rounding"``."""
    if any(k in group for k in _OPTIONS):
        if group.get("stochastic_rounding"):
            return "stochastic"
        return "kahan" if group.get("kahan_summation") else None
    state = state_dict.get("state", {})
    if any("compensation" in state.get(i, {}) for i in group["params"]):
        return "kahan"
    return "stochastic" if "rounding" in state_dict else None


class Rounding:
    """The rounding options of each group, taken before a load and put back after it."""

    def __init__(self, optimizer, state_dict: dict):
        self.opt = optimizer
        self.own = [{k: g[k] for k in _OPTIONS if k in g} for g in optimizer.param_groups]
        self.saved = [saved_rounding(state_dict, g) for g in state_dict["param_groups"]]
        self.has_seed = "rounding" in state_dict

    def restore(self) -> bool:
        """Put the constructor's options back; drop or keep Kahan buffers to match, warn once
        if anything differed. True when the checkpoint's stochastic-rounding seed applies."""
        opt = self.opt
        dropped = fresh = 0
        changed = []
        for group, own, saved in zip(opt.param_groups, self.own, self.saved, strict=True):
            for k in _OPTIONS:
                group.pop(k, None)
            group.update(own)
            mode = opt.rounding(group)
            if mode != saved:
                changed.append((saved, mode))
            for p in group["params"]:
                state = opt.state.get(p, {})
                if mode != "kahan" and state.pop("compensation", None) is not None:
                    dropped += 1
                elif mode == "kahan" and "compensation" not in state and state:
                    fresh += 1
        if changed:
            _warn(type(opt).__name__, changed, dropped, fresh, self.has_seed)
        return self.has_seed and any(opt.rounding(g) == "stochastic" for g in opt.param_groups)


def _warn(owner: str, changed: list, dropped: int, fresh: int, had_seed: bool) -> None:
    saved, mode = changed[0]
    notes = []
    if dropped:
        notes.append(
            f"the checkpoint's Kahan compensation buffers ({dropped} params) were dropped: "
            "what earlier bf16 roundings lost (under half a bf16 ulp per weight) is not added "
            "back"
        )
    if mode == "kahan":
        notes.append(
            "the Kahan compensation buffers start from zero"
            + (f" ({fresh} params)" if fresh else "")
        )
    if mode == "stochastic":
        notes.append("stochastic rounding draws its bits from this optimizer's own seed")
    if had_seed and mode != "stochastic":
        notes.append("the checkpoint's stochastic-rounding seed and step are not used")
    warnings.warn(
        f"{owner}.load_state_dict: the checkpoint was saved with {_NAMES[saved]} of bf16 "
        f"updates, this optimizer was built with {_NAMES[mode]}: it keeps {_NAMES[mode]}, as "
        f"constructed; {'; '.join(notes) or 'nothing else changes'}. Build the optimizer with "
        "the checkpoint's option to resume its rounding exactly.",
        CheckpointRoundingWarning,
        stacklevel=4,
    )


# ---- fp32 masters without amp ---------------------------------------------------------------


def _amp_loads_masters(optimizer) -> bool:
    """True when amp set this optimizer up: its load hooks put the masters where they go."""
    return getattr(amp_stash(optimizer), "amp_state", None) is not None


def saved_masters(optimizer, state_dict: dict) -> dict[int, torch.Tensor]:
    """``{position in the optimizer's param order: fp32 master}`` of a checkpoint that amp
    will not handle (no amp here); empty when it holds none or amp handles them."""
    if _amp_loads_masters(optimizer):
        return {}
    ids = _flat_ids(state_dict["param_groups"])
    pos = {pid: i for i, pid in enumerate(ids)}
    found = {}
    extra = state_dict.get(MASTERS_KEY)
    if isinstance(extra, dict):
        found.update({pos[pid]: t for pid, t in extra.items() if pid in pos})
    for pid, entry in state_dict["state"].items():
        if pid in pos and isinstance(entry, dict) and "master_param" in entry:
            found[pos[pid]] = entry["master_param"]
    return {i: t for i, t in found.items() if isinstance(t, torch.Tensor)}


class MastersWithoutAmp:
    """An O2 checkpoint's fp32 masters, loaded by a fused optimizer that amp did not set up."""

    def __init__(self, optimizer, state_dict: dict):
        self.opt = optimizer
        self.found = saved_masters(optimizer, state_dict)
        params = _flat_ids(optimizer.param_groups)
        self.pairs = [(params[i], t) for i, t in sorted(self.found.items())]
        for i, (p, t) in zip(sorted(self.found), self.pairs, strict=True):
            if not t.is_floating_point() or t.numel() != p.numel():
                raise ValueError(
                    f"{type(optimizer).__name__}.load_state_dict: the checkpoint's fp32 master of "
                    f"param {i} is a {t.dtype} tensor of {t.numel()} elements, the param has "
                    f"{p.numel()}; load a checkpoint of the same model. Nothing was loaded."
                )
        keeps = optimizer.master_weights
        orphans = [p for p, _ in self.pairs if p.dtype in _HALF and not keeps]
        if orphans:
            p = orphans[0]
            raise ValueError(
                f"{type(optimizer).__name__}.load_state_dict: the checkpoint holds fp32 master "
                f"weights (an amp O2 checkpoint) for {len(orphans)} half params (the first of "
                f"shape {tuple(p.shape)}), but this optimizer keeps no masters, so they would be "
                "rounded away. Set the model up as it was saved: `model, optimizer = "
                "amp.initialize(model, optimizer, opt_level='O2')` before loading (or build "
                "the optimizer with master_weights=True), or load into an fp32 model, which "
                "takes the masters as its weights. Nothing was loaded."
            )

    @torch.no_grad()
    def apply(self) -> list:
        """After the load: fp32 params take their masters (no stray ``master_param`` left),
        half params keep them as masters. Returns the ``(param, fp32 value)`` pairs that a
        model load of half weights afterwards must not round (see :func:`keep_carried`)."""
        carried = []
        for p, t in self.pairs:
            value = t.detach().to(device=p.device, dtype=torch.float32).reshape(p.shape)
            state = self.opt.state.get(p)
            if p.dtype == torch.float32:
                p.copy_(value)
                if state is not None:
                    state.pop("master_param", None)
                carried.append((p, value.clone()))
            else:
                self.opt._mpnb_set_master(p, value)
        return carried


@torch.no_grad()
def keep_carried(carried: list) -> None:
    """Before the first step after a load: an fp32 param that now holds exactly the half
    rounding of the master it was loaded with (the model's half checkpoint, loaded after the
    optimizer's) gets the master back."""
    for p, v in carried:
        if not torch.equal(p, v) and any(torch.equal(p, v.to(h).float()) for h in _HALF):
            p.copy_(v)
