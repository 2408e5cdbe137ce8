"""Per-optimizer amp state: fp32 masters in ``param_groups``, unscale, and the skipped step.

The optimizer object is never replaced and ``optimizer.step`` is never rewritten: amp works
through ``register_step_pre_hook`` / ``register_step_post_hook`` and the state-dict hooks,
and this object only holds a weak reference to the optimizer.
"""

from __future__ import annotations

import weakref
from itertools import repeat
from operator import is_, is_not

import torch

from mpnb.core.amp._skip import drop_grads, is_torch_optim, snapshot
from mpnb.core.amp.scaler import LossScaler
from mpnb.core.ops._registry import any_grad, read_grads, unscale_grads

__all__ = ["OptimizerAmp"]

_HALF = (torch.float16, torch.bfloat16)


def _groups_by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    out: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault(t.dtype, []).append(i)
    return out


def _contiguous_grad(p: torch.Tensor) -> torch.Tensor:
    if not p.grad.is_contiguous():
        p.grad = p.grad.contiguous()
    return p.grad


def _dense(tensors) -> bool:
    return all(t.is_contiguous() for t in tensors)


class OptimizerAmp:
    """What amp keeps for one optimizer.

    Args:
        optimizer: a ``torch.optim.Optimizer`` whose params are the (already cast) model's.
        master_weights: replace each half param in ``param_groups`` by an fp32 master.

    The fused-optimizer seam: an optimizer with ``_mpnb_accepts_scale = True`` is not unscaled
    by amp. Before each ``step()`` amp calls ``optimizer._mpnb_set_scale(inv_scale, found_inf)``
    (one-element fp32 device tensors); the optimizer must unscale its grads by ``inv_scale``,
    set ``found_inf`` to 1 on inf/NaN and then leave params and state untouched. After the step
    amp reads ``found_inf`` (its one host sync) and updates the loss scale. Such an optimizer
    takes one ``loss_id`` per step. Under O2, if it also has ``_mpnb_use_master_weights()``,
    amp calls it and leaves the half params in ``param_groups``: the optimizer keeps the fp32
    masters in its own state. On this path the grads stay scaled until ``step()`` (clip them
    inside the optimizer, not through ``amp.master_params``).

    Per step the work is a fixed number of kernel calls, whatever the number of params: one
    ``multi_tensor_scale`` per dtype for the unscale (model grads into fp32 master grads under
    O2), one for the master -> model copy, and one host read. The param lists are built once
    (again only when ``add_param_group`` adds a group); each step reads every ``.grad`` once
    before and once after the backward, which is the Python work that remains.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, master_weights: bool):
        self._opt = weakref.ref(optimizer)
        self.fused = bool(getattr(optimizer, "_mpnb_accepts_scale", False))
        # A fused optimizer that keeps fp32 masters itself (one pass reads the half grads and
        # writes masters and half params): amp places no masters of its own.
        self.internal_masters = (
            master_weights and self.fused and hasattr(optimizer, "_mpnb_use_master_weights")
        )
        if self.internal_masters:
            optimizer._mpnb_use_master_weights()
            master_weights = False
        self.master_weights = master_weights
        self.model_params: list[torch.nn.Parameter] = []
        self.masters: list[torch.nn.Parameter] = []
        self.own: list[torch.nn.Parameter] = []  # params whose .grad the optimizer reads directly
        self._n_groups = 0
        self._adopt_new_groups(optimizer)
        dev = (self.masters or self.own or [torch.empty(0)])[0].device
        self.step_flag = torch.zeros(1, dtype=torch.float32, device=dev)
        self._flag: torch.Tensor | None = None  # step_flag, or a scaler's found_inf (lent)
        self._copy_flag = torch.zeros(1, dtype=torch.float32, device=dev)  # ignored by copies
        self.used: list[LossScaler] = []
        self.pending_delay = False
        self._stashed = False
        self._skip: tuple | None = None
        self.hooks = [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
            optimizer.register_state_dict_post_hook(self._state_dict_post),
            optimizer.register_load_state_dict_pre_hook(self._load_pre),
            optimizer.register_load_state_dict_post_hook(self._load_post),
        ]
        self._loaded_masters: list[torch.Tensor] | None = None
        self.host_syncs = 0  # counts the one device->host read per step (tests assert on it)

    def _adopt_new_groups(self, optimizer) -> None:
        """Sort the params of groups not seen yet into masters/own and cache the lists."""
        for group in optimizer.param_groups[self._n_groups :]:
            for i, p in enumerate(group["params"]):
                if self.master_weights and p.dtype in _HALF:
                    m = torch.nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
                    group["params"][i] = m
                    if p in optimizer.state:
                        optimizer.state[m] = optimizer.state.pop(p)
                    self.model_params.append(p)
                    self.masters.append(m)
                else:
                    self.own.append(p)
        self._n_groups = len(optimizer.param_groups)
        self._stash: list[torch.Tensor | None] = [None] * len(self.own)
        self._own_dense = _dense(self.own)
        self._own_one_dtype = len({p.dtype for p in self.own}) <= 1
        # Master pairs grouped by model dtype once: one kernel call per group and step.
        self._pairs = [
            ([self.model_params[i] for i in idx], [self.masters[i] for i in idx])
            for idx in _groups_by_dtype(self.model_params).values()
        ]
        self._pairs_dense = _dense(self.model_params) and _dense(self.masters)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        opt = self._opt()
        if opt is None:
            raise RuntimeError("amp: the optimizer was garbage collected.")
        return opt

    # ---- backward -------------------------------------------------------------------------

    def prepare_backward(self) -> None:
        """Before a backward: stash already unscaled grads so the new scaled ones start at zero."""
        opt = self._opt()
        if opt is not None and len(opt.param_groups) != self._n_groups:
            self._adopt_new_groups(opt)  # add_param_group after amp.initialize
        if self.pending_delay or self.fused:
            return
        if not any_grad(self.own):  # the common case: zero_grad() left every grad None
            return
        for i, (p, g) in enumerate(zip(self.own, read_grads(self.own), strict=True)):
            if g is not None:
                self._stash[i], p.grad = g, None
                self._stashed = True

    def own_flag(self) -> None:
        """Copy a lent overflow flag into ``step_flag`` (its scaler is about to clear it)."""
        if self._flag is not None and self._flag is not self.step_flag:
            self.step_flag.copy_(self._flag)
            self._flag = self.step_flag

    def after_backward(self, scaler: LossScaler, delay_unscale: bool, alone: bool = False) -> None:
        """After a backward: unscale into the grads the optimizer reads (unless delayed).

        ``alone``: this optimizer is the only one of the ``scale_loss`` block, so the scaler's
        ``found_inf`` is its own overflow flag and needs no copy.
        """
        if scaler not in self.used:
            self.used.append(scaler)
        if delay_unscale:
            self.pending_delay = True
            return
        self.pending_delay = False
        if self.fused:
            if self.masters:
                self._to_masters(scaler, torch.zeros_like(self.step_flag), None)
            return
        if self.own:
            self._unscale_own(scaler)
        if self.masters:
            self._to_masters(scaler, scaler.found_inf, scaler.inv_scale)
        if self._flag is None and alone:  # the common case: one block, one optimizer
            self._flag = scaler.lend_flag(self)
            return
        self.own_flag()
        torch.maximum(self.step_flag, scaler.found_inf, out=self.step_flag)
        self._flag = self.step_flag

    def unscale_and_update(self, scaler: LossScaler) -> bool:
        """The common ``scale_loss`` exit in one C++ call: unscale, then the scale update.

        Taken when this optimizer is the block's only one, its grads unscale in place (no
        fp32 masters of amp's, no fused seam, nothing stashed from an earlier backward, no
        delay) and its overflow flag is not yet set this step. Returns False, having done
        nothing, otherwise; the caller then runs :meth:`after_backward` and
        :meth:`LossScaler.update`.
        """
        if (
            self.fused
            or self.masters
            or self._stashed
            or self._flag is not None
            or not self.own
            or not self._own_one_dtype
        ):
            return False
        if not unscale_grads(self.own, scaler.found_inf, scaler.inv_scale, scaler.update_args()):
            return False
        if scaler not in self.used:
            self.used.append(scaler)
        self.pending_delay = False
        self._flag = scaler.lend_flag(self)
        return True

    def _unscale_own(self, scaler: LossScaler) -> None:
        if not self._stashed:  # the common case: one backward per step, a fast path
            if unscale_grads(self.own, scaler.found_inf, scaler.inv_scale):
                return  # read and unscaled in C++: one kernel call, no Python grad objects
            grads = read_grads(self.own, drop_none=True)
            # Autograd gives a grad its param's dtype and layout: dense params, dense grads.
            if not self._own_dense:
                grads = [_contiguous_grad(p) for p in self.own if p.grad is not None]
            if self._own_one_dtype:
                scaler.unscale(grads, grads)
            else:
                for sub in _groups_by_dtype(grads).values():
                    g = [grads[j] for j in sub]
                    scaler.unscale(g, g)
            return
        idx = [i for i, p in enumerate(self.own) if p.grad is not None]
        for i, p in enumerate(self.own):  # unused in this backward: keep the stashed grad
            if p.grad is None and self._stash[i] is not None:
                p.grad = self._stash[i]
        grads = [_contiguous_grad(self.own[i]) for i in idx]
        for sub in _groups_by_dtype(grads).values():
            g = [grads[j] for j in sub]
            scaler.unscale(g, g, accumulate=[self._stash[idx[j]] for j in sub])
        self._stash = [None] * len(self.own)
        self._stashed = False

    def _to_masters(self, scaler: LossScaler, flag, scale_tensor) -> None:
        """``master.grad = model.grad * scale_tensor`` (fp32; added to an existing master grad)."""
        from mpnb.core.ops import multi_tensor_scale

        for params, masters in self._pairs:
            grads = read_grads(params)
            if not all(map(is_, read_grads(masters), repeat(None))) or not all(
                map(is_not, grads, repeat(None))
            ):
                self._to_masters_general(params, masters, flag, scale_tensor)
                continue
            # The common case: every model param has a grad and no master has one yet.
            if not self._pairs_dense:
                grads = [_contiguous_grad(p) for p in params]
            out = [torch.empty_like(m) for m in masters]
            multi_tensor_scale(flag, grads, out, 1.0, scale_tensor=scale_tensor)
            for m, o in zip(masters, out, strict=True):
                m.grad = o
            for p in params:
                p.grad = None  # consumed: the next backward starts fresh

    def _to_masters_general(self, params, masters, flag, scale_tensor) -> None:
        from mpnb.core.ops import multi_tensor_scale

        idx = [i for i, p in enumerate(params) if p.grad is not None]
        if not idx:
            return
        grads = [_contiguous_grad(params[i]) for i in idx]
        out = [torch.empty_like(masters[i]) for i in idx]
        multi_tensor_scale(flag, grads, out, 1.0, scale_tensor=scale_tensor)
        old = [masters[i].grad for i in idx]
        pairs = [(o, g) for o, g in zip(out, old, strict=True) if g is not None]
        if pairs:
            torch._foreach_add_([o for o, _ in pairs], [g for _, g in pairs])
        for i, o in zip(idx, out, strict=True):
            masters[i].grad = o
            params[i].grad = None  # consumed: the next backward starts fresh

    # ---- step -----------------------------------------------------------------------------

    def _pre_step(self, optimizer, args, kwargs):
        if not self.used:
            return None
        if self.pending_delay:
            raise RuntimeError(
                "amp: optimizer.step() after scale_loss(..., delay_unscale=True) with no "
                "unscale: the grads are still scaled. End the accumulation with a scale_loss "
                "block that has delay_unscale=False before stepping."
            )
        if self.fused:
            if len(self.used) > 1:
                raise ValueError(
                    "amp: an optimizer with _mpnb_accepts_scale takes one loss_id per step, got "
                    f"{len(self.used)}; use one loss_id for it, or a separate optimizer per loss."
                )
            s = self.used[0]
            s.clear_overflow()
            optimizer._mpnb_set_scale(s.inv_scale, s.found_inf)
            return None
        # The one host sync of the step: the overflow flag and every scale used, together.
        if len(self.used) == 1 and self._flag is self.used[0].found_inf:
            vals = self.used[0].read()
        else:
            vals = torch.cat([self._flag, *(s.scale for s in self.used)]).tolist()
        self.host_syncs += 1
        skip = vals[0] > 0 and any(s.dynamic for s in self.used)
        for s, scale in zip(self.used, vals[1:], strict=False):
            s.note_step(skip, scale)
        if skip:
            self._skip = drop_grads(optimizer) if is_torch_optim(optimizer) else snapshot(optimizer)
        return None

    def _post_step(self, optimizer, args, kwargs):
        skipped = False
        if self._skip is not None:
            self._skip[0](self._skip[1])
            self._skip, skipped = None, True
        elif self.fused and self.used:
            s = self.used[0]
            s.update()
            found, scale = torch.cat([s.found_inf, s.scale]).tolist()
            self.host_syncs += 1
            skipped = found > 0
            s.note_step(skipped, scale)
        if not skipped:
            self.copy_masters_to_model()
        if self.used:
            self.used, self.pending_delay = [], False
            if self._flag is self.step_flag:
                self.step_flag.zero_()
            self._flag = None

    def copy_masters_to_model(self) -> None:
        """``model_param = master`` (rounded to half) for every pair, one kernel call a dtype."""
        if not self.masters:
            return
        from mpnb.core.ops import multi_tensor_scale

        with torch.no_grad():
            if not self._pairs_dense:
                torch._foreach_copy_(self.model_params, self.masters)
                return
            for params, masters in self._pairs:  # fp32 * 1.0 is exact: a plain rounding copy
                multi_tensor_scale(self._copy_flag, masters, params, 1.0)

    # ---- state dict: the fp32 masters travel with the optimizer's state ---------------------

    def _state_dict_post(self, optimizer, state):
        if self.masters:
            state["mpnb_amp_masters"] = [m.detach() for m in self.masters]
        return state

    def _load_pre(self, optimizer, state):
        self._loaded_masters = state.get("mpnb_amp_masters")

    def _load_post(self, optimizer):
        saved, self._loaded_masters = self._loaded_masters, None
        if saved is None or not self.masters:
            return
        if len(saved) != len(self.masters):
            raise ValueError(
                f"amp: the optimizer state holds {len(saved)} fp32 master params but this "
                f"optimizer has {len(self.masters)}; load a checkpoint of the same model and "
                "opt level."
            )
        with torch.no_grad():
            src = [s.to(m.device) for s, m in zip(saved, self.masters, strict=True)]
            torch._foreach_copy_(self.masters, src)
        self.copy_masters_to_model()

    def refresh_masters_from_model(self) -> None:
        """After ``model.load_state_dict``: masters that disagree with the model are re-read."""
        with torch.no_grad():
            for p, m in zip(self.model_params, self.masters, strict=False):
                if not torch.equal(m.to(p.dtype), p):
                    m.copy_(p)
