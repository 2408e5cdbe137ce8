"""``AmpHandle``: the state of one ``amp.initialize`` call, and its ``scale_loss`` blocks.

Entering and leaving ``scale_loss`` never syncs with the host: the loss is multiplied by the
scale on the device, and the unscale (``multi_tensor_scale`` with the device ``inv_scale``)
and the scale update (:meth:`~mpnb.core.amp.LossScaler.update`) write their results on the
device. The one host read of a step happens in ``optimizer.step()`` (see
:mod:`mpnb.core.amp._state`).
"""

from __future__ import annotations

import warnings

import torch

from mpnb.core.amp import _checkpoint
from mpnb.core.amp._properties import Properties
from mpnb.core.amp.scaler import LossScaler
from mpnb.core.amp.seam import amp_stash

__all__ = ["AmpHandle", "Fp32StateDict", "RoundedWeightsWarning"]

_HALF = (torch.float16, torch.bfloat16)


class RoundedWeightsWarning(UserWarning):
    """A checkpoint's half weights went into fp32 params without their fp32 masters."""


class _ScaleLossBlock:
    """One ``scale_loss`` block (a class, not a generator: this runs every step)."""

    __slots__ = ("handle", "loss", "states", "loss_id", "delay", "scaler")

    def __init__(self, handle, loss, states, loss_id, delay):
        self.handle, self.loss, self.states = handle, loss, states
        self.loss_id, self.delay, self.scaler = loss_id, delay, None

    def __enter__(self) -> torch.Tensor:
        h = self.handle
        if not isinstance(self.loss, torch.Tensor):
            raise TypeError(
                f"amp.scale_loss: loss must be a torch.Tensor, got {type(self.loss).__name__}; "
                "pass the loss tensor itself (not loss.item() or a Python number)."
            )
        if not h.properties.enabled:
            return self.loss
        n = len(h.scalers)
        if not 0 <= self.loss_id < n:
            raise ValueError(
                f"amp.scale_loss: loss_id={self.loss_id} but amp.initialize(num_losses="
                f"{n}) made loss ids 0..{n - 1}; pass a valid loss_id or raise num_losses."
            )
        scaler = h.scalers[self.loss_id]
        for st in self.states:
            st.check_enter()
        for st in h.opt_states:  # grads waiting, scaled, that this block would disturb
            if st.deferred is not None and (st.deferred is scaler or st in self.states):
                st.unscale_deferred()
        for st in self.states:
            st.enter()
        scaler.clear_overflow()
        self.scaler = scaler
        return scaler.scale_loss(self.loss)

    def __exit__(self, exc_type, exc, tb) -> bool:
        scaler = self.scaler
        if scaler is None:
            return False
        if exc_type is not None:  # a backward interrupted (error, Ctrl-C): drop its grads
            for st in self.states:
                st.abort()
            return False
        if self.delay:
            for st in self.states:
                st.exit_delayed(scaler)
            return False
        alone = len(self.states) == 1
        unscaled = False
        for st in self.states:
            unscaled |= st.exit_unscale(scaler, alone)
        if unscaled:
            scaler.update()
        return False


class AmpHandle:
    """Everything one ``amp.initialize`` set up: properties, scalers, optimizer states, hooks.

    Args:
        properties: the resolved :class:`~mpnb.core.amp.Properties`.
        scalers: one :class:`~mpnb.core.amp.LossScaler` per ``loss_id``.

    Attributes:
        properties: as given (stable: Apex views are built on it).
        scalers: as given (stable: Apex's ``_amp_state.loss_scalers`` view reads it).
        opt_states: one :class:`~mpnb.core.amp._state.AmpOptimizerState` per optimizer.
        hooks: removable handles of the model hooks.

    Example::

        >>> model, opt = amp.initialize(model, opt, opt_level="O2")
        >>> handle = amp.current_handle()
        >>> with handle.scale_loss(loss, opt) as scaled:
        ...     scaled.backward()
        >>> opt.step()
    """

    def __init__(self, properties: Properties, scalers: list[LossScaler]):
        self.properties = properties
        self.scalers = scalers
        self.opt_states: list = []
        self.hooks: list = []
        self.cast_hooks: list = []  # O1's autocast hooks (among ``hooks``)
        self._incoming: dict = {}  # fp32 checkpoint values for half params, during a load
        self._incoming_rounded: torch.dtype | None = None
        self._rounded_warned = False

    def scale_loss(
        self, loss: torch.Tensor, optimizers, loss_id: int = 0, delay_unscale: bool = False
    ) -> _ScaleLossBlock:
        """A context manager yielding ``loss * scale``; on exit it unscales the grads.

        Args:
            loss: the loss tensor.
            optimizers: one optimizer of this handle, or a list of them.
            loss_id: which loss scaler (``0 .. num_losses-1``).
            delay_unscale: keep the grads scaled to accumulate more backwards first.

        The grads of the optimizers' params are unscaled when the block exits without an
        exception; a block that raises drops the grads its backward produced. On overflow
        the following ``optimizer.step()`` is skipped (dynamic scale).
        """
        opts = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
        return _ScaleLossBlock(self, loss, [self.state_of(o) for o in opts], loss_id, delay_unscale)

    def state_of(self, optimizer):
        """The amp state of ``optimizer`` (ValueError if it is not one of this handle's)."""
        stash = amp_stash(optimizer)
        if stash is None or getattr(stash, "handle", None) is not self:
            raise ValueError(
                "amp: this optimizer was not passed to this amp.initialize; call `model, "
                "optimizer = amp.initialize(model, optimizer, opt_level=...)` first and use the "
                "optimizer it returns."
            )
        return stash.amp_state

    # ---- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """``{"loss_scaler0": {...}, ...}`` (Apex's keys; one host sync per scaler)."""
        return {f"loss_scaler{i}": s.state_dict() for i, s in enumerate(self.scalers)}

    def load_state_dict(self, state) -> None:
        """Restore :meth:`state_dict` output into the scalers: all of it or, on any bad entry
        (ValueError naming the key), nothing. A scaler whose saved kind (dynamic / static)
        differs from the run's keeps its own state; one ``LossScaleStateWarning`` says so."""
        if not hasattr(state, "keys"):
            raise ValueError(
                f"amp.load_state_dict: expected the dict amp.state_dict() returned, got "
                f"{type(state).__name__}."
            )
        keys = sorted(k for k in state if isinstance(k, str) and k.startswith("loss_scaler"))
        expected = [f"loss_scaler{i}" for i in range(len(self.scalers))]
        if sorted(keys) != sorted(expected):
            raise ValueError(
                f"amp.load_state_dict: the state has the loss scalers {keys} but "
                f"amp.initialize(num_losses={len(self.scalers)}) made {expected}; initialize "
                "with the num_losses the checkpoint was saved with."
            )
        pairs = zip(self.scalers, expected, strict=True)
        resolved = [_checkpoint.resolve_scaler_state(s, state[k], k) for s, k in pairs]
        _checkpoint.warn_kept_scales([note for _, note in resolved])
        for s, (checked, _) in zip(self.scalers, resolved, strict=True):
            s.apply_state(checked)

    def model_load_pre(self, module, state_dict, prefix, local_metadata=None, *args) -> None:
        """Before ``model.load_state_dict``: note fp32 values meant for half params (their
        masters take them exactly) and half values meant for fp32 params (rounded). An
        O2/O3 model's state dict holds its half weights as fp32 (Apex's format); its metadata
        says so (:class:`Fp32StateDict`), and those values count as half ones."""
        self._incoming, rounded = {}, None
        marked = local_metadata.get(Fp32StateDict.KEY) if isinstance(local_metadata, dict) else None
        marked = marked if isinstance(marked, dict) else {}
        for name, p in module.named_parameters():
            t = state_dict.get(prefix + name)
            if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                continue
            half = t.dtype if t.dtype in _HALF else _HALF_NAMES.get(marked.get(name))
            if p.dtype in _HALF and t.dtype == torch.float32 and half is None:
                self._incoming[p] = t
            elif p.dtype == torch.float32 and half is not None:
                rounded = half
        self._incoming_rounded = rounded

    @torch.no_grad()
    def model_load_post(self, module, incompatible) -> None:
        """After ``model.load_state_dict``: masters re-read (or carried), never dropped silently."""
        incoming, self._incoming = self._incoming, {}
        carried = False
        for st in self.opt_states:
            carried |= _refresh(st, incoming)
        rounded, self._incoming_rounded = self._incoming_rounded, None
        if rounded is not None and not carried and not self._rounded_warned:
            self._rounded_warned = True
            warnings.warn(
                f"amp: the model checkpoint holds {rounded} weights (an O2/O3 checkpoint), so "
                "these fp32 params now hold rounded half values. Load the optimizer state "
                "saved with it as well: amp carries its fp32 master weights into the params.",
                RoundedWeightsWarning,
                stacklevel=3,
            )

    def _deactivate(self) -> None:
        """Apex's ``_amp_state.handle._deactivate()``: end O1's casts (the models' autocast
        hooks come off; the models run as they were). Loss scaling and the optimizers'
        state stay. A no-op at the other levels, whose casts are the model's dtypes."""
        for h in self.cast_hooks:
            h.remove()
        self.hooks = [h for h in self.hooks if h not in self.cast_hooks]
        self.cast_hooks = []

    def remove_hooks(self) -> None:
        """Detach every model and optimizer hook this handle registered."""
        for h in self.hooks:
            h.remove()
        for st in self.opt_states:
            for h in st.hooks:
                h.remove()
        self.hooks = []


class Fp32StateDict:
    """``model.state_dict()`` post-hook of an O2/O3 model: its half tensors saved as fp32.

    Apex's checkpoint format (its ``O2StateDictHook``): a checkpoint of a half model loads
    into an fp32 model, and back, in either library. Registered with PyTorch's public
    ``Module.register_state_dict_post_hook``; tensors asked for with ``keep_vars=True`` (the
    live parameters) are left as they are. The converted values are the model's rounded
    weights, not the masters (those travel with the optimizer's state), so the module's
    metadata notes which entries were half, and in which dtype (``KEY``: ``{name: dtype
    name}``), read back by :meth:`AmpHandle.model_load_pre`.

    Example::

        >>> model, opt = amp.initialize(model, opt, opt_level="O2")
        >>> {t.dtype for t in model.state_dict().values() if t.is_floating_point()}
        {torch.float32}
    """

    KEY = "mpnb_amp_half_weights"

    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        converted = {}
        for k, v in list(state_dict.items()):
            if not k.startswith(prefix) or not isinstance(v, torch.Tensor):
                continue
            if v.dtype in _HALF and not isinstance(v, torch.nn.Parameter):
                converted[k[len(prefix) :]] = str(v.dtype).split(".")[-1]
                state_dict[k] = v.float()
        if converted:
            local_metadata[self.KEY] = converted  # {name: its half dtype}


_HALF_NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _refresh(st, incoming: dict) -> bool:
    """Bring ``st``'s fp32 values in line with a freshly loaded model; True if a checkpoint's
    fp32 masters (carried by an optimizer load) were kept over rounded model values."""
    st.strategy.follow_model(st.optimizer, incoming)
    kept = False
    for p, v in st.carried:  # O0/O1/O3: a model load after the optimizer's must not round
        if not torch.equal(p, v) and any(torch.equal(p, v.to(h).float()) for h in _HALF):
            p.copy_(v)
            kept = True
    return kept or bool(st.carried)
