"""What every fused optimizer shares: gathering lists, master weights, the loss-scale seam.

A subclass checks its hyper-parameters with :func:`check_hyperparams`, names its fp32 state
(``_state_keys``) and implements ``_update(group, bucket, inv_scale, found_inf)``, which calls
one op of :mod:`mpnb.core.ops` (``adam``, ``sgd``, ...). Everything else lives here:

* **Buckets.** A group's params are split by (device, param dtype, grad dtype); each bucket is
  one kernel call (a kernel takes one dtype per list).
* **Master weights.** With ``master_weights=True`` every fp16/bf16 param gets an fp32 copy in
  ``state[p]["master_param"]`` (saved by ``state_dict``); the kernel updates it and writes the
  rounded value into the param in the same pass.
* **Loss scale.** ``_mpnb_set_scale(inv_scale, found_inf)`` (mpnb.amp) or the
  ``grad_scale``/``found_inf`` attributes that ``torch.amp.GradScaler.step`` sets (because
  ``_step_supports_amp_scaling`` is True) hand the scale to the step: grads are unscaled in
  the kernel, and on inf/NaN nothing is written and ``found_inf`` is 1.
* **Apex's attributes.** ``_dummy_overflow_buf`` and, per class, Apex's ``multi_tensor_*``
  ops (:mod:`mpnb.core.amp_C`, callable through ``multi_tensor_applier`` with Apex's
  positional signatures), for code that subclasses Apex's optimizers (fairseq's
  ``FusedAdamV2``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from mpnb.core.ops.check_finite import multi_tensor_check_finite
from mpnb.core.optimizers._checks import check_hyperparams, check_loadable, number

__all__ = ["FusedOptimizerBase", "check_hyperparams"]


_HALF = (torch.float16, torch.bfloat16)


@dataclass
class Bucket:
    """One kernel call's lists: params, grads, masters (maybe empty), fp32 state per key."""

    params: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    masters: list = field(default_factory=list)
    states: list = field(default_factory=list)  # the state dicts, one per param
    index: list = field(default_factory=list)  # each param's position in its group
    lists: dict = field(default_factory=dict)  # state key -> cached list of state tensors


@dataclass
class _Plan:
    """A group's buckets, reused by later steps while what they were built from is unchanged.

    Building the buckets walks every param (state lookups, dtype keys, checks). A step whose
    params (by identity), ``optimizer.state`` and master setting match the plan's, and where
    every param has a grad, only gathers the new grads.
    """

    ids: list
    state: object
    nstate: int
    master: bool
    buckets: list

    def fits(self, params: list, state, master: bool) -> bool:
        return (
            state is self.state
            and master == self.master
            and len(state) == self.nstate
            and list(map(id, params)) == self.ids
        )


class FusedOptimizerBase(torch.optim.Optimizer):
    """Base of mpnb's fused optimizers (a real ``torch.optim.Optimizer``)."""

    _state_keys: tuple[str, ...] = ()
    _has_step = True
    _check_grads = True  # run the read-only finite pre-pass when a scale is handed over
    _mpnb_accepts_scale = True
    _step_supports_amp_scaling = True

    def __init__(
        self, params, defaults: dict, *, master_weights: bool = False, set_grad_none: bool = True
    ) -> None:
        super().__init__(params, defaults)
        self.master_weights = bool(master_weights)
        self.set_grad_none = bool(set_grad_none)
        self._pending_scale: tuple | None = None
        self._plans: dict[int, _Plan] = {}
        self._dummy_overflow_buf = self._new_overflow_buf()

    def _new_overflow_buf(self) -> torch.Tensor:
        dev = next((p.device for g in self.param_groups for p in g["params"]), None)
        return torch.zeros(1, dtype=torch.int32, device=dev)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("master_weights", False)
        self.__dict__.setdefault("set_grad_none", True)
        self._pending_scale = None
        self._plans = {}
        self._dummy_overflow_buf = self._new_overflow_buf()

    # -- the loss-scale seam ---------------------------------------------------------------
    def _mpnb_set_scale(
        self, inv_scale: torch.Tensor, found_inf: torch.Tensor, skip: bool = True
    ) -> None:
        """Hand the next ``step()`` a loss scale to undo and a flag to set on overflow.

        Args:
            inv_scale: one-element fp32 tensor, ``1 / loss_scale``.
            found_inf: one-element fp32 tensor; ``step()`` sets it to 1 when a grad holds
                inf/NaN (and, when it is already nonzero, takes the step as overflowed).
            skip: True: an overflowing step writes nothing (params, masters, state, step
                counts). False (a static loss scale, Apex's rule): it is flagged but taken.
        """
        for name, t in (("inv_scale", inv_scale), ("found_inf", found_inf)):
            if not isinstance(t, torch.Tensor) or t.numel() != 1:
                raise TypeError(f"_mpnb_set_scale: {name} must be a one-element tensor.")
        self._pending_scale = (inv_scale, found_inf, bool(skip))

    def _mpnb_use_master_weights(self) -> None:
        """Switch on fp32 master weights (mpnb.amp O2 calls this instead of copying params)."""
        self.master_weights = True
        self._plans.clear()

    @torch.no_grad()
    def _mpnb_set_master(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Make ``value`` the fp32 master of the half param ``p`` (amp restores checkpointed
        masters through this, whichever optimizer saved them)."""
        state = self.state[p]
        if not state:
            if self._has_step:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            self._init_state(p, state)
        state["master_param"] = (
            value.detach().to(device=p.device, dtype=torch.float32).reshape(p.shape).clone()
        )
        self._plans.clear()

    def _take_scale(self):
        if self._pending_scale is not None:
            inv, found, skip = self._pending_scale
            self._pending_scale = None
            return inv.float(), found, self._check_grads, skip
        found = getattr(self, "found_inf", None)
        scale = getattr(self, "grad_scale", None)
        # torch.amp.GradScaler already ran its own finite check: no pre-pass here.
        inv = None if scale is None else scale.double().reciprocal().float()
        return inv, found, False, True

    # -- gathering -------------------------------------------------------------------------
    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        """Create the fp32 state of ``p`` (default: zeros for each of ``_state_keys``)."""
        for k in self._state_keys:
            state[k] = torch.zeros_like(
                p, dtype=torch.float32, memory_format=torch.contiguous_format
            )

    def _buckets(self, group: dict) -> list[Bucket]:
        params = group["params"]
        plan = self._plans.get(id(group))
        if plan is not None and plan.fits(params, self.state, self.master_weights):
            grads = [p.grad for p in params]
            if not any(g is None for g in grads):
                for b in plan.buckets:
                    b.grads = [grads[i] for i in b.index]
                return plan.buckets
        buckets: dict[tuple, Bucket] = {}
        complete = True  # every param has a dense contiguous grad: the plan may be reused
        for i, p in enumerate(params):
            if p.grad is None:
                complete = False
                continue
            if p.grad.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients; "
                    "use torch.optim.SparseAdam or dense grads."
                )
            if not p.is_contiguous():
                raise RuntimeError(
                    f"{type(self).__name__}: a param of shape {tuple(p.shape)} is "
                    "not contiguous; make it contiguous before building the "
                    "optimizer (param.data = param.data.contiguous())."
                )
            state = self.state[p]
            if not state:
                if self._has_step:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                self._init_state(p, state)
            use_master = self.master_weights and p.dtype in _HALF
            if use_master and "master_param" not in state:
                state["master_param"] = p.detach().float().clone()
            key = (p.device, p.dtype, p.grad.dtype, use_master)
            b = buckets.get(key)
            if b is None:
                b = buckets[key] = Bucket()
            b.params.append(p)
            if p.grad.is_contiguous():
                b.grads.append(p.grad)
            else:
                complete = False
                b.grads.append(p.grad.contiguous())
            if use_master:
                b.masters.append(state["master_param"])
            b.states.append(state)
            b.index.append(i)
        out = list(buckets.values())
        if complete:
            self._plans[id(group)] = _Plan(
                list(map(id, params)), self.state, len(self.state), self.master_weights, out
            )
        else:
            self._plans.pop(id(group), None)
        return out

    @staticmethod
    def state_list(bucket: Bucket, key: str) -> list[torch.Tensor]:
        """The ``key`` state tensor of every param of ``bucket`` (cached with the bucket)."""
        out = bucket.lists.get(key)
        if out is None:
            out = bucket.lists[key] = [s[key] for s in bucket.states]
        return out

    # -- the step --------------------------------------------------------------------------
    def _prepare(self, work, inv_scale, found_inf) -> None:
        """Hook before any update, with every bucket of every group known (LAMB: grad norm)."""

    def _update(self, group: dict, bucket: Bucket, inv_scale, found_inf) -> None:
        """One bucket's update; every fused optimizer class defines it."""
        raise NotImplementedError(
            f"{type(self).__name__} derives from the fused-optimizer base but does not define "
            "_update(group, bucket, inv_scale, found_inf); implement it to call its kernel."
        )

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; see the class docstring for the math.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inv_scale, found_inf, check, skip = self._take_scale()
        work = [(g, self._buckets(g)) for g in self.param_groups]
        if found_inf is not None and check:
            for _, buckets in work:
                for b in buckets:
                    multi_tensor_check_finite(found_inf, b.grads)
        self._prepare(work, inv_scale, found_inf)
        flag = found_inf if skip else None  # a static scale: flagged, but the step is taken
        for group, buckets in work:
            for b in buckets:
                self._update(group, b, inv_scale, flag)
        return loss

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear grads; ``set_grad_none`` (Apex) picks ``None`` over zeros by default."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    # -- checkpoints -----------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a checkpoint of this optimizer or of its PyTorch counterpart, all or nothing.

        The checkpoint is validated first (group sizes, every state tensor's size, step
        counts). ``torch.optim.Optimizer.load_state_dict`` casts floating state to each param's
        dtype; the fused optimizers keep their state (and master weights) in fp32, so the saved
        fp32 tensors are put back, and group keys the checkpoint lacks get our defaults.
        """
        check_loadable(self, state_dict)
        self._plans.clear()
        saved = state_dict["state"]
        ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        super().load_state_dict(state_dict)
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(ids, params, strict=False):
            state = self.state.get(p, {})
            for k, v in saved.get(pid, {}).items():
                if k not in state:  # a load pre-hook took it out (amp: masters it keeps)
                    continue
                if not isinstance(v, torch.Tensor):
                    if k == "step":
                        state[k] = torch.tensor(number(v), dtype=torch.float32)
                    continue
                dtype = torch.float32 if v.is_floating_point() else v.dtype
                state[k] = v.to(device=p.device, dtype=dtype, copy=True).contiguous()
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)
