"""Apex's ``apex.amp._amp_state``, as a compatibility surface: a view onto mpnb's amp handle.

Apex kept its amp state in a module-level singleton that client code reaches into, for example
``amp._amp_state.loss_scalers[0].loss_scale()`` to log the scale, or NVIDIA's BERT recipe's
``amp._amp_state.loss_scalers[0]._loss_scale = 2**20`` to start from a larger scale. mpnb keeps
that state in the handle of the latest ``amp.initialize`` (:func:`mpnb.amp.current_handle`);
this module shows it under Apex's names and owns nothing:

* ``loss_scalers``: one :class:`LossScalerView` per loss; the private fields client code sets
  (``_loss_scale``, ``_scale_seq_len``, ``_unskipped``, ``_max_loss_scale``,
  ``_min_loss_scale``) go to the scaler's own settings and state (so the scaler's own rule,
  clamp and device state stay in charge), everything else is read-only;
* ``opt_properties``: the resolved, frozen :class:`mpnb.amp.Properties`;
* ``handle``: the :class:`mpnb.amp.AmpHandle` itself.

Before any ``amp.initialize`` these raise ``AttributeError`` (as Apex's did). The modern
equivalent of all of this is ``torch.amp.GradScaler.get_scale()``.

Example::

    >>> from apex.amp._amp_state import _amp_state      # under mpnb's Apex alias
    >>> _amp_state.loss_scalers[0].loss_scale()
    65536.0
"""

from __future__ import annotations

from mpnb.core.amp import current_handle, master_params

__all__ = ["AmpStateView", "LossScalerView", "master_params"]

_VIEWED = ("loss_scalers", "opt_properties", "handle")


def _handle():
    try:
        return current_handle()
    except ValueError as e:  # Apex: the attribute does not exist before initialize
        raise AttributeError(str(e)) from None


class LossScalerView:
    """Apex's ``LossScaler`` attributes over one of mpnb's :class:`mpnb.amp.LossScaler`.

    Reading gives the scaler's current values. The private fields client code sets (NVIDIA's
    BERT sets ``_loss_scale``, GNMT ``_scale_seq_len``) are assignable and go to the scaler's
    own settings: ``_loss_scale`` and ``_unskipped`` through its ``load_state_dict`` (so the
    scaler's clamp and device state stay in charge), ``_scale_seq_len``, ``_max_loss_scale``
    and ``_min_loss_scale`` to its rule (``scale_window``, ``max_loss_scale``,
    ``min_loss_scale``), validated there. Anything else is read-only.

    Args:
        scaler: the real scaler (``current_handle().scalers[i]``).

    Example::

        >>> view = LossScalerView(amp.current_handle().scalers[0])
        >>> view._scale_seq_len = 128            # GNMT: grow every 128 clean steps
        >>> view.loss_scale(), view.dynamic, amp.current_handle().scalers[0].scale_window
        (65536.0, True, 128)
    """

    __slots__ = ("_scaler",)

    def __init__(self, scaler) -> None:
        object.__setattr__(self, "_scaler", scaler)

    def loss_scale(self) -> float:
        """The current scale (a host sync, as in Apex)."""
        return self._scaler.loss_scale()

    def _set_state(self, key: str, value) -> None:
        state = self._scaler.state_dict()
        state[key] = value
        self._scaler.load_state_dict(state)

    @property
    def _loss_scale(self) -> float:
        return self._scaler.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        self._set_state("loss_scale", float(value))

    @property
    def dynamic(self) -> bool:
        return self._scaler.dynamic

    @property
    def _unskipped(self) -> int:
        return int(self._scaler.state_dict()["unskipped"])

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        self._set_state("unskipped", value)

    @property
    def _max_loss_scale(self) -> float:
        return self._scaler.max_loss_scale

    @_max_loss_scale.setter
    def _max_loss_scale(self, value: float) -> None:
        self._scaler.max_loss_scale = value

    @property
    def _min_loss_scale(self) -> float | None:
        return self._scaler.min_loss_scale

    @_min_loss_scale.setter
    def _min_loss_scale(self, value: float | None) -> None:
        self._scaler.min_loss_scale = value

    @property
    def _scale_seq_len(self) -> int:
        return self._scaler.scale_window

    @_scale_seq_len.setter
    def _scale_seq_len(self, value: int) -> None:
        self._scaler.scale_window = value

    def __setattr__(self, name: str, value) -> None:
        if isinstance(getattr(type(self), name, None), property) and name in _WRITABLE:
            object.__setattr__(self, name, value)
            return
        raise AttributeError(
            f"amp._amp_state.loss_scalers[i].{name} is read-only in mpnb (a view onto the real "
            f"scaler; assignable: {', '.join(_WRITABLE)}). Pass loss-scale settings to "
            "amp.initialize (loss_scale=, min_loss_scale=, max_loss_scale=) instead."
        )

    def __repr__(self) -> str:
        return f"LossScalerView({self._scaler!r})"


_WRITABLE = ("_loss_scale", "_scale_seq_len", "_unskipped", "_max_loss_scale", "_min_loss_scale")


class AmpStateView:
    """Apex's ``_amp_state`` object: read-only, onto the latest ``amp.initialize``'s handle.

    Example::

        >>> AmpStateView().opt_properties.opt_level
        'O1'
    """

    __slots__ = ()

    @property
    def handle(self):
        return _handle()

    @property
    def loss_scalers(self) -> tuple[LossScalerView, ...]:
        return tuple(LossScalerView(s) for s in _handle().scalers)

    @property
    def opt_properties(self):
        return _handle().properties

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(
            f"amp._amp_state.{name} is read-only in mpnb (a view onto "
            "mpnb.amp.current_handle()); pass the setting to amp.initialize instead."
        )


_amp_state = AmpStateView()


def __getattr__(name: str):
    # ``amp._amp_state`` is this module when reached as an attribute of ``apex.amp``; Apex's
    # object had these attributes, so the module answers for them too.
    if name in _VIEWED:
        return getattr(_amp_state, name)
    raise AttributeError(f"module 'apex.amp._amp_state' (mpnb's view) has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_VIEWED])
