"""The three ways an amp step runs, one small object each, chosen once per optimizer.

* :class:`InPlaceUnscale` (O0, O1, O3): the grads the optimizer reads are unscaled in place
  when a ``scale_loss`` block ends.
* :class:`MasterWeights` (O2 with an optimizer that keeps no masters of its own): amp places fp32
  masters in ``optimizer.param_groups``; a block's end unscales the half model grads into fp32
  master grads, and a step ends by copying the masters back into the model.
* :class:`FusedSeam` (an optimizer that implements :class:`~mpnb.core.amp.seam.FusedOptimizer`,
  e.g. ``mpnb.optimizers``): the grads stay scaled and the optimizer's ``step()`` unscales,
  checks and updates in one pass. Under O2 such an optimizer keeps the fp32 masters itself
  when it offers them.

Each strategy works on lists built once (again only when ``add_param_group`` adds a group): a
step makes one multi-tensor call per dtype group, and its Python work per parameter is reading
``.grad`` (and, for masters, setting the fp32 master's ``.grad``). The per-optimizer state
machine (:mod:`mpnb.core.amp._state`) decides when each method runs.
"""

from __future__ import annotations

import torch

from mpnb.core.amp._grads import Grads, Masters
from mpnb.core.amp._skip import drop_grads, is_torch_optim, snapshot
from mpnb.core.amp.scaler import LossScaler
from mpnb.core.amp.seam import Binding, bind

__all__ = ["Strategy", "InPlaceUnscale", "MasterWeights", "FusedSeam", "choose_strategy"]

_HALF = (torch.float16, torch.bfloat16)


class Strategy:
    """What the state machine asks of a step; the parts the three strategies share.

    Args:
        optimizer: the optimizer whose params (already cast by amp) this strategy serves.
        master_weights: O2: fp32 masters for the half params (amp's, or the optimizer's own).
    """

    name = "in-place"
    internal_masters = False  # the optimizer keeps the fp32 masters itself (FusedSeam, O2)

    def __init__(self, optimizer: torch.optim.Optimizer, master_weights: bool):
        self.own = Grads()
        self.masters: Masters | None = Masters() if master_weights else None
        self._n_groups = 0
        self._skip: tuple | None = None
        self._handed = False  # found_inf handed to the optimizer for this step
        self._device_skip = takes_found_inf(optimizer)  # decided once, as the strategy
        self.adopt(optimizer)

    def adopt(self, optimizer) -> None:
        """Sort the params of groups not seen yet into masters and in-place params."""
        if len(optimizer.param_groups) == self._n_groups:
            return
        own = []
        for group in optimizer.param_groups[self._n_groups :]:
            for i, p in enumerate(group["params"]):
                if self.masters is not None and p.dtype in _HALF:
                    self.masters.adopt(optimizer, group, i, p)
                else:
                    own.append(p)
        self.own.add(own)
        if self.masters is not None:
            self.masters.rebuild()
        self._n_groups = len(optimizer.param_groups)

    def follow_model(self, optimizer, incoming: dict | None = None) -> None:
        """Bring the fp32 masters in line with the model's current weights (see
        :meth:`~mpnb.core.amp._grads.Masters.follow_model`)."""
        if self.masters is not None:
            self.masters.follow_model(incoming)

    # ---- a scale_loss block ------------------------------------------------------------

    def before_backward(self, st, keep_scaled: bool) -> None:
        """A block starts; ``keep_scaled``: the grads hold delayed (still scaled) values."""
        self.own.before_backward(keep_scaled)
        if self.masters is not None:
            self.masters.before_backward(keep_scaled)

    def unscale(self, st, scaler: LossScaler, alone: bool) -> bool:
        """A block ended: unscale its grads now (True), or leave them to the step (False)."""
        self.own.unscale(scaler)
        if self.masters is not None:
            self.masters.unscale(scaler)
        return True

    def discard(self, st) -> None:
        """A block raised: drop what it produced (the grads from before it stay)."""
        self.own.discard()
        if self.masters is not None:
            self.masters.discard()

    # ---- the step: skipped on the device, or after one host read --------------------------

    def pre_step(self, st, optimizer) -> None:
        """Decide how an overflowing step is skipped, and count the step.

        A static scale (every scaler of the step static) takes the step whatever the flag
        (Apex's rule). Otherwise an optimizer that takes ``found_inf`` (``torch.optim``'s fused
        optimizers: ``_step_supports_amp_scaling``) is handed the step's flag through
        GradScaler's door and skips on the device; any other optimizer (``torch.optim``'s
        Python loops) needs the flag on the host: the step's one host read, as in torch.amp.
        """
        flag, skip = _step_flag(st), _skips(st)
        self._skip = None
        if skip and self._device_skip:
            optimizer.found_inf = flag.reshape(())
            self._handed = True
        elif skip:
            st.host_syncs += 1
            if bool(flag.item() > 0):
                restore = drop_grads if is_torch_optim(optimizer) else snapshot
                self._skip = restore(optimizer)
        _count_step(st, flag, skip)

    def post_step(self, st, optimizer) -> None:
        """Undo a skipped step's bookkeeping, or copy the new masters into the model.

        After a step skipped on the device the masters hold what they held, so the copy writes
        the model's own values again (each model param is its master rounded, from the first
        step on)."""
        skip, self._skip = self._skip, None
        if self._handed:
            self.end_handoff(optimizer)
        if skip is not None:
            skip[0](skip[1])
        elif self.masters is not None:
            self.masters.copy_to_model()
        if self.masters is not None:
            self.masters.release_grads()

    def end_handoff(self, optimizer) -> None:
        """Take back the flag handed to the optimizer (also after a step that raised)."""
        if self._handed:
            self._handed = False
            optimizer.__dict__.pop("found_inf", None)


def takes_found_inf(optimizer) -> bool:
    """True when ``optimizer.step()`` skips on a ``found_inf`` attribute set before it, as
    ``torch.amp.GradScaler`` hands it (``_step_supports_amp_scaling``: ``torch.optim``'s fused
    optimizers), so that amp's step needs no host read."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _step_flag(st) -> torch.Tensor:
    """The step's overflow flag: its blocks' flags together (a one-element device tensor)."""
    return st.flags[0] if len(st.flags) == 1 else torch.cat(st.flags).amax(0, True)


def _skips(st) -> bool:
    """An overflowing step is skipped when some scaler of the step is dynamic (host-known)."""
    return any([s.rule.dynamic for s in st.scalers])


def _count_step(st, flag: torch.Tensor, skip: bool) -> None:
    """Count the step in every scaler's device counters, then let each look at them without
    waiting (a static scale's warning, the collapse error)."""
    for i, s in enumerate(st.scalers):
        s.note_step(flag, skip, first=i == 0)
    for s in st.scalers:
        s.watch()


class InPlaceUnscale(Strategy):
    """O0/O1/O3: grads unscaled in place at the end of each ``scale_loss`` block."""

    name = "in-place"

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__(optimizer, master_weights=False)


class MasterWeights(Strategy):
    """O2: amp's fp32 masters in ``param_groups``; half grads unscaled into their grads."""

    name = "master-weights"

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__(optimizer, master_weights=True)


class FusedSeam(Strategy):
    """The optimizer unscales, checks and skips inside its own ``step()``.

    A step with one block leaves the grads scaled (``st.deferred`` holds its scaler) and hands
    ``(inv_scale, found_inf)`` to the optimizer (:meth:`FusedOptimizer._mpnb_set_scale
    <mpnb.core.amp.seam.FusedOptimizer._mpnb_set_scale>`); the scale update and the step's one
    host read follow the step. A step with several blocks (several ``loss_id``s, accumulation,
    or another optimizer's block on the same scaler) unscales each block in place as
    :class:`InPlaceUnscale` does and hands the optimizer a scale of 1 with the combined flag.
    Under O2 an optimizer that offers its own masters keeps them; one without gets amp's
    masters (unscaled into, as :class:`MasterWeights`).

    Args:
        optimizer: the optimizer, already checked by :func:`~mpnb.core.amp.seam.bind`.
        binding: what that check found.
    """

    name = "fused-seam"

    def __init__(self, optimizer: torch.optim.Optimizer, master_weights: bool, binding: Binding):
        if binding.own_masters:
            optimizer._mpnb_use_master_weights()
        super().__init__(optimizer, master_weights and not binding.own_masters)
        self.internal_masters = binding.own_masters
        self._flag: torch.Tensor | None = None
        dev = next((p.device for g in optimizer.param_groups for p in g["params"]), None)
        self._one = torch.ones(1, dtype=torch.float32, device=dev)

    @torch.no_grad()
    def follow_model(self, optimizer, incoming: dict | None = None) -> None:
        """As :meth:`Strategy.follow_model`, also for the masters the optimizer keeps (made
        from the params at its first step, or set from a checkpoint before it)."""
        super().follow_model(optimizer, incoming)
        if not self.internal_masters:
            return
        for p in self.own.params:
            if p.dtype not in _HALF:
                continue
            m = optimizer.state.get(p, {}).get("master_param")
            if incoming and p in incoming:
                optimizer._mpnb_set_master(p, incoming[p])
            elif m is not None and not torch.equal(m.to(p.dtype), p):
                m.copy_(p)

    def unscale(self, st, scaler: LossScaler, alone: bool) -> bool:
        """Leave a step's single block scaled for the optimizer (False), else unscale now."""
        if alone and self.masters is None and not st.flags and st.deferred is None:
            st.deferred = scaler
            return False
        return super().unscale(st, scaler, alone)

    def unscale_deferred(self, st) -> None:
        """The grads ``st.deferred`` left scaled are needed now (another block is coming, or
        the user reads them): unscale them in place, update that scale, keep its flag."""
        s, st.deferred = st.deferred, None
        self.own.unscale(s)
        s.update()
        st.flags.append(s.found_inf)

    def pre_step(self, st, optimizer) -> None:
        """Hand the optimizer the scale to undo (1 if already unscaled) and the flag."""
        if st.deferred is not None:
            inv, flag = st.deferred.inv_scale, st.deferred.found_inf
        else:
            inv, flag = self._one, _step_flag(st)
        self._flag = flag
        # a static scale: the optimizer flags inf/NaN but steps anyway (Apex)
        optimizer._mpnb_set_scale(inv, flag, skip=_skips(st))

    def post_step(self, st, optimizer) -> None:
        """The deferred scale update, then the step counted on the device: no host read (the
        optimizer skipped an overflowing step itself, on the device)."""
        if st.deferred is not None:
            s, st.deferred = st.deferred, None
            s.update()
        flag, self._flag = self._flag, None
        _count_step(st, flag, _skips(st))
        if self.masters is not None:
            self.masters.copy_to_model()  # a skipped step left the masters as they were
            self.masters.release_grads()


def choose_strategy(
    optimizer: torch.optim.Optimizer, master_weights: bool, binding: Binding | None = None
) -> Strategy:
    """The strategy for ``optimizer``: the fused seam if it has one, else masters or in place.

    Args:
        optimizer: the optimizer amp serves.
        master_weights: O2's fp32 masters.
        binding: what :func:`~mpnb.core.amp.seam.bind` found (None: bind it now).

    Example::

        >>> choose_strategy(torch.optim.SGD(model.parameters(), lr=0.1), True).name
        'master-weights'
    """
    binding = binding or bind(optimizer, master_weights)
    if binding.fused_unscale:
        return FusedSeam(optimizer, master_weights, binding)
    return MasterWeights(optimizer) if master_weights else InPlaceUnscale(optimizer)
