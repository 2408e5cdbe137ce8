"""Tensor memory, measured: a ``TorchDispatchMode`` that follows every live tensor storage.

Every tensor an op produces or reads inside the mode is recorded once per *storage* (views
and in-place results share their base's bytes), and is forgotten when the storage itself is
freed: a ``weakref.finalize`` on the storage object, which PyTorch keeps alive exactly as long
as the storage. The running total gives the peak; at the peak the live storages are split by
role, by identity with the model and the optimizer at that moment (a storage without a role
then takes the first role it gets while it lives: a gradient autograd has computed but not yet
stored in ``.grad`` is a grad):

* ``params``: the model's parameters (half under O2/O3) and buffers;
* ``master_weights``: fp32 params the optimizer updates that are not the model's (O2's
  masters in ``param_groups``, or a fused optimizer's ``state[p]["master_param"]``);
* ``grads``: ``.grad`` of either;
* ``optimizer_state``: every other tensor in ``optimizer.state``;
* the extra state a precision configuration stores, each kind its own role, as the
  configurations declare it (:data:`mpnb.core.precision_configs.STORED_ROLES`):
  ``fp8_scales``, the buffers of :class:`mpnb.fp8.Float8Linear` layers (the delayed recipe's
  ``fp8_amax_history`` and ``fp8_scale``; the current-scaling recipes keep none, their
  per-step scales are short-lived and count as activations), and ``kahan_buffers``, the
  Kahan compensation buffers of a fused optimizer built with ``kahan_summation=True``;
* ``activations``: everything else (saved activations, temporaries, inputs, outputs).

This is what a CPU has no allocator statistics for. On CUDA the runner reports
``torch.cuda.max_memory_allocated`` as the peak and uses this tracker for the breakdown.

Example::

    >>> tracker = MemoryTracker(model, optimizer)
    >>> with tracker:
    ...     train_step()
    >>> tracker.peak_bytes, tracker.breakdown()      # {'params': ..., 'activations': ...}
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mpnb.core.precision_configs import STORED_ROLES

__all__ = ["MemoryTracker", "ROLES", "storage_roles"]

ROLES = (
    "params",
    "grads",
    "master_weights",
    "optimizer_state",
    *(stored.role for stored in STORED_ROLES),
    "activations",
)


def _state_role(key: str) -> str:
    """The role of the optimizer state entry ``key`` (a fused optimizer's fp32 master copy)."""
    return "master_weights" if key == "master_param" else "optimizer_state"


def _storage(t: torch.Tensor):
    if not isinstance(t, torch.Tensor) or t.is_sparse or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without a storage (e.g. wrappers)
        return None


def storage_roles(model: torch.nn.Module | None, optimizer=None) -> dict[int, str]:
    """``{id(storage): role}`` for the params, grads, masters and state of model/optimizer now."""
    roles: dict[int, str] = {}

    def put(t, role):
        st = _storage(t)
        if st is not None:
            roles.setdefault(id(st), role)

    model_params = list(model.parameters()) if model is not None else []
    for p in model_params:
        put(p, "params")
        if p.grad is not None:
            put(p.grad, "grads")
    for stored in STORED_ROLES:  # before the generic buffer and state roles below
        for t in stored.find(model, optimizer):
            put(t, stored.role)
    if model is not None:
        for b in model.buffers():
            put(b, "params")
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                put(p, "master_weights")
                if p.grad is not None:
                    put(p.grad, "grads")
        for state in optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    put(v, _state_role(str(k)))
    return roles


class MemoryTracker(TorchDispatchMode):
    """Peak bytes of live tensor storages inside the mode, split by role at the peak.

    Args:
        model: the model whose params/grads/buffers are classified (optional).
        optimizer: the optimizer whose params, grads and state are classified (optional).

    Tensors that exist before the mode is entered count from the start if they belong to
    ``model`` or ``optimizer`` (params, grads, state), and from their first use in an op
    otherwise. ``peak_bytes``, ``breakdown()``, ``entry_bytes`` (the resident bytes at entry)
    and ``ops`` (the ops dispatched inside) are readable afterwards; entering again starts a
    new measurement.

    Example::

        >>> with MemoryTracker() as m:
        ...     x = torch.empty(1024, dtype=torch.float32)
        >>> m.peak_bytes
        4096
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer=None):
        super().__init__()
        self.model, self.optimizer = model, optimizer
        self._live: dict[int, tuple[int, weakref.finalize]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._at_peak: dict[int, str] | None = None  # role per storage at the peak
        self._peak_sizes: dict[int, int] = {}
        self._dirty = False
        self.entry_bytes = 0
        self.ops = 0  # ops dispatched inside the mode (kernel launches, on a GPU)
        self._roles: dict[int, str] = {}
        self._stale = True  # a storage appeared since the roles were read: re-read them
        # The peak's storages whose role is read again at the next safe point: a storage can
        # take its role after it appeared (autograd assigns ``p.grad`` after the op that made
        # the gradient returned, with no op in between), and a snapshot, taken while a storage
        # is being freed, cannot read ``p.grad`` itself.
        self._unresolved: dict[int, weakref.finalize] = {}

    # ---- bookkeeping --------------------------------------------------------------------

    def _add(self, t) -> None:
        st = _storage(t)
        if st is None:
            return
        key = id(st)
        if key in self._live:
            return
        n = st.nbytes()
        fin = weakref.finalize(st, self._free, key)
        fin.atexit = False
        self._live[key] = (n, fin)
        self.live_bytes += n
        self._stale = True
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self._dirty = True

    def _free(self, key: int) -> None:
        # Runs inside a storage's deallocation: touch no tensor here (reading p.grad while
        # it is being replaced crashes), only the dicts. Roles come from the last safe point.
        if self._dirty:  # the first free after a rise: the live set is the peak's live set
            self._snapshot()
        n, _ = self._live.pop(key, (0, None))
        self.live_bytes -= n

    def _snapshot(self) -> None:
        self._at_peak = {k: self._roles.get(k, "activations") for k in self._live}
        self._peak_sizes = {k: n for k, (n, _) in self._live.items()}
        self._unresolved = {
            k: fin for k, (_, fin) in self._live.items() if self._at_peak[k] == "activations"
        }
        self._dirty = False

    def _refresh_roles(self) -> None:
        """Re-read the roles (at a safe point: no storage is being freed) when a storage appeared
        since the last read or the peak's roles wait to be confirmed."""
        if self._stale or self._unresolved:
            self._roles = storage_roles(self.model, self.optimizer)
            self._stale = False
        if self._unresolved:
            self._resolve_peak()

    def _resolve_peak(self) -> None:
        # A peak storage without a role that is still alive (the same storage: its finalizer is
        # the one recorded) and has a role now was about to get it at the peak (a gradient not
        # yet in ``.grad``). The others wait for the next safe point; one freed meanwhile was a
        # temporary and stays an activation.
        pending = {}
        for k, fin in self._unresolved.items():
            live = self._live.get(k)
            if live is None or live[1] is not fin:
                continue
            if k in self._roles:
                self._at_peak[k] = self._roles[k]
            else:
                pending[k] = fin
        self._unresolved = pending

    # ---- the mode -------------------------------------------------------------------------

    def __enter__(self):
        self.live_bytes = self.peak_bytes = self.ops = 0
        self._at_peak, self._peak_sizes, self._stale = None, {}, True
        self._unresolved = {}
        for t in self._known_tensors():
            self._add(t)
        self.entry_bytes = self.live_bytes  # the model's and optimizer's resident tensors
        self._refresh_roles()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._dirty:
                self._snapshot()
            self._refresh_roles()
            for _, fin in self._live.values():
                fin.detach()  # stop following storages that outlive the mode
            self._live.clear()

    def _known_tensors(self):
        ts = []
        if self.model is not None:
            ts += [p for p in self.model.parameters()] + list(self.model.buffers())
            ts += [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.optimizer is not None:
            for g in self.optimizer.param_groups:
                ts += list(g["params"]) + [p.grad for p in g["params"] if p.grad is not None]
            for state in self.optimizer.state.values():
                ts += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return ts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        self._refresh_roles()  # a safe point: no storage is being freed right now
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out

    # ---- results ------------------------------------------------------------------------

    def breakdown(self) -> dict[str, int]:
        """Bytes per role (:data:`ROLES`) at the peak; they sum to ``peak_bytes``."""
        out = dict.fromkeys(ROLES, 0)
        for k, role in (self._at_peak or {}).items():
            out[role] += self._peak_sizes[k]
        return out
