"""amp's per-optimizer state machine, and ``optimizer._amp_stash``, Apex's view of it.

Each optimizer passed to ``amp.initialize`` gets one :class:`AmpOptimizerState`. It moves
through :class:`OptState` on ``scale_loss`` blocks and ``optimizer.step()`` (seen through
``register_step_pre_hook``/``register_step_post_hook``; ``optimizer.step`` is never replaced),
checks each transition and raises an error that names the fix on misuse. The work itself is
done by the optimizer's strategy (:mod:`mpnb.core.amp._strategies`).

Host syncs: none in a steady-state step with a fused optimizer (mpnb's, through the seam, or
``torch.optim``'s ``fused=True``, through GradScaler's ``found_inf`` door): the step is skipped
on the device and counted there. A ``torch.optim`` optimizer whose step is a Python loop needs
the overflow flag on the host: one read per step, in the strategy's ``pre_step``, as in
torch.amp. The first step also compares each fp32 master with its model param once (see
:meth:`~mpnb.core.amp._strategies.Strategy.follow_model`).
"""

from __future__ import annotations

import enum
import weakref

import torch

from mpnb.core._saved_groups import SavedGroups
from mpnb.core.amp import _checkpoint
from mpnb.core.amp._strategies import Strategy
from mpnb.core.amp.scaler import LossScaler

__all__ = ["OptState", "AmpOptimizerState", "AmpStash"]


class OptState(enum.Enum):
    """Where one optimizer's step is (as ``torch.amp.GradScaler``'s ``OptState``).

    ``READY``: no ``scale_loss`` block yet this step. ``SCALING``: inside a block.
    ``DELAYED``: blocks ended with ``delay_unscale=True``; the grads are still scaled.
    ``UNSCALED``: a block ended and its grads are unscaled (or handed, scaled, to a fused
    optimizer); ``step()`` may run. ``STEPPED``: ``step()`` ran; the next block starts a step.
    """

    READY = "ready"
    SCALING = "scaling"
    DELAYED = "delayed"
    UNSCALED = "unscaled"
    STEPPED = "stepped"


_MISUSE = {
    OptState.SCALING: (
        "amp: optimizer.step() inside an open amp.scale_loss block: its grads are still "
        "scaled. Call optimizer.step() after the with-block has ended."
    ),
    OptState.DELAYED: (
        "amp: optimizer.step() after scale_loss(..., delay_unscale=True) with no unscale: the "
        "grads are still scaled. End the accumulation with a scale_loss block that has "
        "delay_unscale=False before stepping."
    ),
    OptState.STEPPED: (
        "amp: optimizer.step() called twice after one backward: the grads were already used "
        "(and, under O2, consumed). Run a new amp.scale_loss block (its backward) before the "
        "next optimizer.step()."
    ),
}


class AmpOptimizerState:
    """amp's state for one optimizer: the :class:`OptState`, this step's flags, the hooks.

    Args:
        optimizer: the optimizer (held weakly).
        strategy: how its steps run (:func:`~mpnb.core.amp._strategies.choose_strategy`).
        handle: the :class:`~mpnb.core.amp.AmpHandle` it belongs to.

    Attributes:
        state: the current :class:`OptState`.
        flags: the overflow flags of this step's unscaled blocks (device tensors).
        scalers: the :class:`~mpnb.core.amp.LossScaler` of each block of this step.
        deferred: the scaler of this step's one block whose grads wait, still scaled, for a
            fused optimizer's ``step()`` to unscale them (:class:`~mpnb.core.amp._strategies.
            FusedSeam`); None otherwise. Anything that needs those grads first calls
            :meth:`unscale_deferred`.
        host_syncs: device-to-host reads amp's steps made so far (one per step of an optimizer
            that cannot skip on the device, none otherwise).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: Strategy, handle):
        self._opt = weakref.ref(optimizer)
        self.strategy = strategy
        self.handle = handle
        self.state = OptState.READY
        self.flags: list[torch.Tensor] = []
        self.scalers: list[LossScaler] = []
        self.deferred: LossScaler | None = None
        self.host_syncs = 0
        self.carried: list = []  # fp32 values a checkpoint put into fp32 params (O0/O1/O3)
        self.followed = False  # the masters re-read the model at the first step
        self._found: dict = {}
        self._saved = None  # the checkpoint's param groups, read by the load pre-hook
        self.hooks = [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
            optimizer.register_state_dict_post_hook(self._state_dict_post),
            optimizer.register_load_state_dict_pre_hook(self._load_pre),
            optimizer.register_load_state_dict_post_hook(self._load_post),
        ]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer (RuntimeError once it was garbage collected)."""
        opt = self._opt()
        if opt is None:
            raise RuntimeError("amp: the optimizer was garbage collected.")
        return opt

    # ---- scale_loss blocks ---------------------------------------------------------------

    def check_enter(self) -> None:
        """Raise if a new ``scale_loss`` block may not start now (nothing changes)."""
        if self.state is OptState.SCALING:
            raise RuntimeError(
                "amp.scale_loss: a scale_loss block on this optimizer is already open; blocks "
                "cannot nest on one optimizer. Finish the first block (its backward) and leave "
                "it before opening the next."
            )

    def enter(self) -> None:
        """A block starts: READY/UNSCALED/DELAYED/STEPPED -> SCALING."""
        if self.state is OptState.STEPPED:
            self.state = OptState.READY
        self.strategy.adopt(self.optimizer)  # add_param_group after amp.initialize
        self.strategy.before_backward(self, keep_scaled=self.state is OptState.DELAYED)
        self.state = OptState.SCALING

    def exit_delayed(self, scaler: LossScaler) -> None:
        """A block ended with ``delay_unscale=True``: SCALING -> DELAYED."""
        self._use(scaler)
        self.state = OptState.DELAYED

    def exit_unscale(self, scaler: LossScaler, alone: bool) -> bool:
        """A block ended: SCALING -> UNSCALED. True when its grads were unscaled now (the
        caller then updates the scale); False when the fused optimizer will do it."""
        self._use(scaler)
        now = self.strategy.unscale(self, scaler, alone)
        if now:
            self.flags.append(scaler.found_inf)
        self.state = OptState.UNSCALED
        return now

    def abort(self) -> None:
        """A block raised: SCALING -> UNSCALED (earlier blocks kept) or READY."""
        self.strategy.discard(self)
        if self.flags:
            self.state = OptState.UNSCALED
        else:
            self.scalers = []
            self.state = OptState.READY

    def unscale_deferred(self) -> None:
        """Unscale grads left scaled for a fused optimizer's step (to read or clip them, or
        before another block that would disturb them); the step then only reads the flag."""
        if self.deferred is not None:
            self.strategy.unscale_deferred(self)

    def _use(self, scaler: LossScaler) -> None:
        if scaler not in self.scalers:
            self.scalers.append(scaler)

    # ---- optimizer.step() ------------------------------------------------------------------

    def _pre_step(self, optimizer, args, kwargs):
        state = self.state
        if self.strategy._handed:  # a flag left behind by a step that raised
            self.strategy.end_handoff(optimizer)
        if state is OptState.UNSCALED:
            if not self.followed:
                # Until the first step the model is the truth: DDP's broadcast of rank 0's
                # weights, a load_state_dict or a user's copy after amp.initialize reach the
                # model only; the masters take them now (Apex makes its masters here).
                self.strategy.follow_model(optimizer)
                self.followed = True
            self.strategy.pre_step(self, optimizer)
        elif state is not OptState.READY:  # READY: no scale_loss this step, a plain step
            raise RuntimeError(_MISUSE[state])

    def _post_step(self, optimizer, args, kwargs):
        if self.state is not OptState.UNSCALED:
            return
        try:
            self.strategy.post_step(self, optimizer)
        finally:
            self.flags, self.scalers = [], []
            self.state = OptState.STEPPED

    # ---- checkpoints: the fp32 masters travel with the optimizer's state ---------------------

    def _state_dict_post(self, optimizer, state):
        return _checkpoint.save_masters(self.strategy, optimizer, state)

    def _load_pre(self, optimizer, state):
        saved = SavedGroups(optimizer, state)
        saved.check()  # another optimizer class's checkpoint: refused before any change
        state, self._found = _checkpoint.take_masters(self.strategy, optimizer, state)
        self._saved = saved
        return state

    def _load_post(self, optimizer):
        found, self._found = self._found, {}
        saved, self._saved = self._saved, None
        self.carried = _checkpoint.apply_masters(self.strategy, optimizer, found)
        if saved is not None:
            saved.warn()  # the hyperparameters torch.optim replaced, named once


class AmpStash:
    """``optimizer._amp_stash``: a read-only view of amp's state, under Apex's name.

    A compatibility surface for code written against Apex that reads Apex's private stash
    (for example ``optimizer._amp_stash.all_fp32_from_fp16_params`` to drop the master grads
    after an overflow). It holds no state of its own: every attribute is computed from the
    :class:`AmpOptimizerState` and the optimizer, and assigning one raises. ``amp.scale_loss``
    finds an optimizer's amp state through it.

    Attributes:
        amp_state: the :class:`AmpOptimizerState` (None when amp was initialized disabled).
        handle: the :class:`~mpnb.core.amp.AmpHandle`.
    """

    __slots__ = ("amp_state", "handle")

    def __init__(self, amp_state: AmpOptimizerState | None, handle) -> None:
        object.__setattr__(self, "amp_state", amp_state)
        object.__setattr__(self, "handle", handle)

    def __setattr__(self, name, value):
        if name == "lazy_init_called" and value is True:
            # Apex's resume recipe (NVIDIA's BERT): call _lazy_init_maybe_master_weights(),
            # set this flag, load the optimizer and copy the saved masters in. mpnb's masters
            # need no lazy set-up, so True states what already holds.
            return
        raise AttributeError(
            f"optimizer._amp_stash is a read-only view of amp's state (Apex compatibility); "
            f"it cannot set {name!r} to {value!r} (only lazy_init_called = True, Apex's resume "
            "recipe, is accepted). Change the optimizer or amp's handle instead."
        )

    def lazy_init_maybe_master_weights(self) -> None:
        """Apex's ``optimizer._lazy_init_maybe_master_weights()``: set up this optimizer's fp32
        masters now. amp.initialize made them already (they hold the model's weights and
        follow them), so there is nothing left to do: the call only keeps Apex's resume
        recipe (call it, set ``lazy_init_called``, load, copy the saved masters in) working."""

    def _groups(self) -> list[tuple[list, list, list]]:
        st = self.amp_state
        opt = st.optimizer if st is not None else None
        masters = st.strategy.masters if st is not None else None
        model_of = {}
        if masters is not None:
            model_of = dict(zip(map(id, masters.masters), masters.model, strict=True))
        out = []
        for group in [] if opt is None else opt.param_groups:
            half, from_half, fp32 = [], [], []
            for p in group["params"]:
                if id(p) in model_of:
                    half.append(model_of[id(p)])
                    from_half.append(p)
                elif p.dtype in (torch.float16, torch.bfloat16):
                    half.append(p)
                    m = opt.state.get(p, {}).get("master_param")
                    if m is not None:
                        from_half.append(m)
                else:
                    fp32.append(p)
            out.append((half, from_half, fp32))
        return out

    lazy_init_called = property(
        lambda self: True, doc="Always True (amp sets up at once); assigning True is accepted."
    )
    already_patched = property(lambda self: True, doc="Always True (Apex's patch flag).")

    @property
    def params_have_scaled_gradients(self) -> bool:
        """True while the grads still hold scaled values (inside a block, or delayed)."""
        st = self.amp_state
        return st is not None and st.state in (OptState.SCALING, OptState.DELAYED)

    @property
    def fp16_groups(self) -> list[list]:
        """Per param group: the half model params that have fp32 masters."""
        return [g[0] for g in self._groups()]

    @property
    def fp32_from_fp16_groups(self) -> list[list]:
        """Per param group: the fp32 masters of those half params."""
        return [g[1] for g in self._groups()]

    @property
    def fp32_from_fp32_groups(self) -> list[list]:
        """Per param group: the fp32 params the optimizer updates directly."""
        return [g[2] for g in self._groups()]

    @property
    def all_fp16_params(self) -> list:
        """Every half model param with an fp32 master."""
        return [p for g in self.fp16_groups for p in g]

    @property
    def all_fp32_from_fp16_params(self) -> list:
        """Every fp32 master of a half model param."""
        return [p for g in self.fp32_from_fp16_groups for p in g]

    @property
    def all_fp32_from_fp32_params(self) -> list:
        """Every fp32 param the optimizer updates directly."""
        return [p for g in self.fp32_from_fp32_groups for p in g]
