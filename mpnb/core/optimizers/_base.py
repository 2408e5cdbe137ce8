"""What every fused optimizer shares: gathering lists, master weights, the loss-scale seam.

A subclass checks its hyper-parameters with :func:`check_hyperparams`, names its fp32 state
(``_state_keys``) and implements ``_update(group, bucket, inv_scale, found_inf)``, which calls
one op of :mod:`mpnb.core.ops` (``adam``, ``sgd``, ...). Everything else lives here:

* **Buckets.** A group's params are split by (device, param dtype, grad dtype); each bucket is
  one kernel call (a kernel takes one dtype per list).
* **Master weights.** With ``master_weights=True`` every fp16/bf16 param gets an fp32 copy in
  ``state[p]["master_param"]`` (saved by ``state_dict``); the kernel updates it and writes the
  rounded value into the param in the same pass.
* **Loss scale.** The class implements amp's seam, :class:`mpnb.core.amp.seam.FusedOptimizer`
  (``_mpnb_set_scale(inv_scale, found_inf)`` and the three master-weight methods); the
  ``grad_scale``/``found_inf`` attributes that ``torch.amp.GradScaler.step`` sets are an
  adapter over the same handoff (:class:`~mpnb.core.amp.seam.GradScalerAttribute`). Either way
  grads are unscaled in the kernel, and on inf/NaN nothing is written and ``found_inf`` is 1.
  GradScaler hands its scale over only where ``_step_supports_amp_scaling`` is True,
  which, as in Apex, is ``FusedAdam(capturable=True)`` and ``FusedMixedPrecisionLamb``; after
  such a step the ``.grad``s hold the unscaled values, as Apex's kernels leave them. Every
  other fused optimizer gets its grads unscaled by GradScaler before ``step()``.
* **Pure bf16.** ``stochastic_rounding=True`` or ``kahan_summation=True`` (FusedAdam,
  FusedSGD, FusedLAMB) send bf16 params without masters to the op's ``_bf16`` variant
  (:mod:`mpnb.core.ops._rounding` has the math): :class:`_Rounding` holds the seed (drawn once
  from ``generator``) and the step counter of the random bits, saved by ``state_dict`` under
  ``"rounding"``; Kahan's bf16 buffer is ``state[p]["compensation"]``.
* **No host read, and CUDA graphs.** A step reads no device value on the host: an overflowing
  step is skipped inside the op (``found_inf``), step counts live in tensors and the bias
  corrections are computed from them on the device. So a whole step can be captured in a CUDA
  graph (``torch.cuda.graph``). FusedAdam's learning rate can live on the device too
  (``capturable=True``, or a tensor ``lr``; :meth:`FusedOptimizerBase.lr_args`): an LR
  schedule writes into that tensor and a captured step follows it. The other
  hyper-parameters (betas, weight decay), and the other optimizers' lr, are host numbers,
  fixed in a captured graph (capture again after changing them), and stochastic rounding
  refuses capture (its random bits follow a host counter).
* **Apex's attributes.** ``_dummy_overflow_buf`` and, per class, Apex's ``multi_tensor_*``
  ops (:mod:`mpnb.core.amp_C`, callable through ``multi_tensor_applier`` with Apex's
  positional signatures), for code that subclasses Apex's optimizers (fairseq's
  ``FusedAdamV2``).
"""

from __future__ import annotations

import itertools
import typing
from dataclasses import dataclass, field

import torch

from mpnb.core._saved_groups import SavedGroups
from mpnb.core.amp.seam import GradScalerAttribute, ScaleHandoff
from mpnb.core.ops._library import op_info
from mpnb.core.ops._rounding import mix64
from mpnb.core.ops.check_finite import multi_tensor_check_finite
from mpnb.core.optimizers import _load
from mpnb.core.optimizers._checks import (
    check_hyperparams,
    check_loadable,
    check_param_group,
    group_tensors,
    number,
)

__all__ = ["FusedOptimizerBase", "check_hyperparams"]

# op name -> the names of its arguments an optimizer's param group may hold (group_args)
_GROUP_NAMES: dict[str, frozenset] = {}
# the op's scalars that the step sets itself, whatever the group holds
_CALL_SCALARS = frozenset({"lr", "seed", "rng_step"})


_HALF = (torch.float16, torch.bfloat16)
_MASTERS_POINTLESS = (
    "stochastic_rounding / kahan_summation make bf16 params train without fp32 master "
    "weights; with masters (master_weights=True, amp O2) the update is already exact, so "
    "they would do nothing. Use opt_level='O3' with half_dtype=torch.bfloat16 (the "
    "'bf16-pure+sr' / 'bf16-pure+kahan' configs), or drop the option to keep O2's masters."
)


@dataclass
class Bucket:
    """One kernel call's lists: params, grads, masters (maybe empty), fp32 state per key."""

    params: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    masters: list = field(default_factory=list)
    states: list = field(default_factory=list)  # the state dicts, one per param
    index: list = field(default_factory=list)  # each param's position in its group
    lists: dict = field(default_factory=dict)  # state key -> cached list of state tensors
    ordinal: int = 0  # the bucket's position in this step (mixed into the rounding's seed)


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


_SEED_MASK = (1 << 63) - 1  # seeds travel as the ops' int64 arguments


@dataclass
class _Rounding:
    """The random bits' seed and step counter of stochastic rounding (one per optimizer)."""

    seed: int = 0
    step: int = 0

    def state_dict(self) -> dict:
        return {"seed": self.seed, "step": self.step}


def _draw_seed(generator: torch.Generator | None) -> int:
    """A 62-bit seed from ``generator`` (torch's default generator when None)."""
    return int(torch.randint(0, 1 << 62, (1,), generator=generator).item())


def _refuse_capture(owner: str) -> None:
    """Stochastic rounding's bits come from a host step counter, which a CUDA graph would
    freeze: every replay would round with the same bits (biased, not stochastic)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{owner}(stochastic_rounding=True) cannot be captured in a CUDA graph: its random "
            "bits follow a step counter kept on the host, so every replay would round with the "
            "same bits. Train it without CUDA graphs, or use kahan_summation=True (no random "
            "bits) or fp32 master weights (O2)."
        )


class FusedOptimizerBase(torch.optim.Optimizer):
    """Base of mpnb's fused optimizers (a real ``torch.optim.Optimizer``); implements
    :class:`mpnb.core.amp.seam.FusedOptimizer`."""

    _state_keys: tuple[str, ...] = ()
    _has_step = True
    _check_grads = True  # run the read-only finite pre-pass when amp hands a scale over
    _mpnb_accepts_scale = True
    _step_supports_amp_scaling = False  # torch's GradScaler unscales the grads (Apex's rule)
    grad_scale = GradScalerAttribute("grad_scale")  # set by GradScaler.step around step()
    found_inf = GradScalerAttribute("found_inf")

    def __init__(
        self,
        params,
        defaults: dict,
        *,
        master_weights: bool = False,
        set_grad_none: bool = True,
        stochastic_rounding: bool | None = None,
        kahan_summation: bool | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        owner = type(self).__name__
        if stochastic_rounding is not None:  # the classes that have the options
            sr, kahan = bool(stochastic_rounding), bool(kahan_summation)
            if sr and kahan:
                raise ValueError(
                    f"{owner}: stochastic_rounding and kahan_summation are two ways to round "
                    "the same update back to bf16; pick one (stochastic_rounding=True: no "
                    "extra memory; kahan_summation=True: a 2-byte buffer per param)."
                )
            if (sr or kahan) and master_weights:
                raise ValueError(f"{owner}: {_MASTERS_POINTLESS}")
            defaults = dict(defaults, stochastic_rounding=sr, kahan_summation=kahan)
        super().__init__(params, defaults)
        self._rounding = _Rounding(_draw_seed(generator) if stochastic_rounding else 0)
        self.master_weights = bool(master_weights)
        self.set_grad_none = bool(set_grad_none)
        self._pending_scale: ScaleHandoff | None = None
        self._carried: list = []  # fp32 masters a load without amp put in fp32 params
        self._plans: dict[int, _Plan] = {}
        self._dummy_overflow_buf = self._new_overflow_buf()

    def _new_overflow_buf(self) -> torch.Tensor:
        dev = next((p.device for g in self.param_groups for p in g["params"]), None)
        return torch.zeros(1, dtype=torch.int32, device=dev)

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group`` after
        :func:`~mpnb.core.optimizers._checks.check_param_group` (the constructor's groups pass
        here too): bad numbers and a parameter already in another group are refused before
        anything is added; a parameter listed twice and ``eps=0`` get one warning each."""
        if not isinstance(param_group, dict):  # torch's own TypeError says what it takes
            return super().add_param_group(param_group)
        check_param_group(self, param_group)
        raw = param_group.get("params")  # a list now, if torch will take it
        tensors = group_tensors(raw) if isinstance(raw, list) else []
        if len({id(t) for t in tensors}) == len(tensors):
            return super().add_param_group(param_group)
        # A parameter listed twice: torch's own warning would repeat ours without the fix (and
        # silencing it through a warnings filter would reset the filter's once-per-line record).
        # torch is handed each parameter once; the group then keeps the list as given, so the
        # parameter is updated twice per step, as torch and Apex do.
        first: dict[int, object] = {}
        for t, x in zip(tensors, raw, strict=True):
            first.setdefault(id(t), x)
        param_group["params"] = list(first.values())
        super().add_param_group(param_group)
        param_group["params"] = tensors
        if "param_names" in param_group:
            param_group["param_names"] = [x[0] for x in raw]

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("master_weights", False)
        self.__dict__.setdefault("set_grad_none", True)
        self.__dict__.setdefault("_rounding", _Rounding())
        self._pending_scale = None
        self.__dict__.setdefault("_carried", [])
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
        self._pending_scale = ScaleHandoff(inv_scale, found_inf, bool(skip))

    def _mpnb_check_master_weights(self) -> None:
        """Raise when this optimizer cannot take fp32 master weights (stochastic rounding or
        Kahan summation); mpnb.amp calls it before it changes the model."""
        if any(self.rounding(g) for g in self.param_groups):
            raise RuntimeError(f"{type(self).__name__}: {_MASTERS_POINTLESS}")

    def _mpnb_use_master_weights(self) -> None:
        """Switch on fp32 master weights (mpnb.amp O2 calls this instead of copying params)."""
        self._mpnb_check_master_weights()
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

    def _take_scale(self) -> tuple[ScaleHandoff, bool, bool]:
        """This step's handoff, whether to run the finite pre-pass, and whether to leave the
        unscaled grads in ``.grad`` after the step."""
        amp_handoff, self._pending_scale = self._pending_scale, None
        if amp_handoff is not None:
            inv, found, skip = amp_handoff
            return ScaleHandoff(inv.float(), found, skip), self._check_grads, False
        h = GradScalerAttribute.handoff(self)
        if h is not None:
            # GradScaler ran its own finite check: no pre-pass. Apex's kernels leave the
            # unscaled grads behind, and GradScaler's callers read them after step().
            return h, False, h.inv_scale is not None
        return ScaleHandoff(None, None), False, False

    # -- gathering -------------------------------------------------------------------------
    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        """Create the fp32 state of ``p`` (default: zeros for each of ``_state_keys``)."""
        for k in self._state_keys:
            state[k] = torch.zeros_like(
                p, dtype=torch.float32, memory_format=torch.contiguous_format
            )

    @staticmethod
    def rounding(group: dict) -> str | None:
        """The group's rounding of bf16 updates: ``"stochastic"``, ``"kahan"`` or None."""
        if group.get("stochastic_rounding"):
            return "stochastic"
        return "kahan" if group.get("kahan_summation") else None

    def rounding_args(self, group: dict, bucket: Bucket) -> dict | None:
        """The ``rounding``, ``seed``, ``rng_step`` and ``compensations`` keywords of the
        ``_bf16`` op for ``bucket``, or None when the group rounds to nearest.

        The op's seed mixes the optimizer's seed with the bucket's position in the step, so
        tensors of different buckets (same index in their lists) get independent bits.
        """
        mode = self.rounding(group)
        if mode is None:
            return None
        seed = mix64(self._rounding.seed + bucket.ordinal) & _SEED_MASK
        comps = self.state_list(bucket, "compensation") if mode == "kahan" else []
        return dict(rounding=mode, seed=seed, rng_step=self._rounding.step, compensations=comps)

    def _check_rounding(self, group: dict, p: torch.Tensor, state: dict) -> None:
        mode = self.rounding(group)
        if mode is None:
            return
        option = "stochastic_rounding" if mode == "stochastic" else "kahan_summation"
        if p.dtype != torch.bfloat16:
            fix = (
                "fp32 params need no rounding: build the optimizer without it (or use fp32 "
                "master weights for half params)"
                if p.dtype == torch.float32
                else "convert the model to bfloat16, or use master_weights=True"
            )
            raise TypeError(
                f"{type(self).__name__}({option}=True): a param of shape {tuple(p.shape)} is "
                f"{p.dtype}; {option} is for bfloat16 params without master weights; {fix}."
            )
        if mode == "kahan" and "compensation" not in state:
            state["compensation"] = torch.zeros_like(p, memory_format=torch.contiguous_format)

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
            self._check_rounding(group, p, state)
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

    def group_args(self, group: dict, op_name: str) -> dict:
        """The keywords of the group's op call that the group holds by the op's own names
        (``eps``, ``weight_decay``, ``bias_correction``, ...): a hyperparameter that an op and
        its optimizer name alike reaches the kernel with no line of its own here. Only the op's
        number and flag arguments are taken, never ``lr`` (:meth:`lr_args`) nor the rounding's
        ``seed`` and ``rng_step`` (:meth:`rounding_args`); a name the op lacks is not passed, and
        one the group lacks (loaded from another optimizer's checkpoint) is the default's.

        Example::

            >>> self.group_args({"lr": 1e-3, "eps": 1e-8, "betas": (0.9, 0.99)}, "fused_adam_")
            {'eps': 1e-08}
        """
        names = _GROUP_NAMES.get(op_name)
        if names is None:
            hints = typing.get_type_hints(op_info(op_name).reference)
            scalars = {k for k, t in hints.items() if t in (float, int, bool)}
            names = _GROUP_NAMES[op_name] = frozenset(scalars - _CALL_SCALARS)
        # a group loaded from another optimizer's checkpoint may lack one: the default fills it
        return {
            k: group.get(k, self.defaults.get(k)) for k in names if k in group or k in self.defaults
        }

    @staticmethod
    def lr_args(group: dict) -> dict:
        """The ``lr`` keywords of the group's op call: ``lr=`` the host number, or, when the
        group's lr is a tensor (``FusedAdam(capturable=True)``, or a tensor passed as ``lr``),
        ``lr_tensor=`` that tensor, read on the device by the kernel (no host read; a CUDA graph
        replays it with whatever an LR schedule last wrote into it)."""
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            return dict(lr=0.0, lr_tensor=lr)
        return dict(lr=float(lr))

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
        (inv_scale, found_inf, skip), check, leave_unscaled = self._take_scale()
        work = [(g, self._buckets(g)) for g in self.param_groups]
        if found_inf is not None and check:
            for _, buckets in work:
                for b in buckets:
                    multi_tensor_check_finite(found_inf, b.grads)
        carried, self._carried = self._carried, []
        if carried:
            _load.keep_carried(carried)
        self._prepare(work, inv_scale, found_inf)
        flag = found_inf if skip else None  # a static scale: flagged, but the step is taken
        if any(self.rounding(g) == "stochastic" for g in self.param_groups):
            _refuse_capture(type(self).__name__)
            self._rounding.step += 1  # also on a skipped step: the bits stay a pure counter
        ordinal = 0
        for group, buckets in work:
            for b in buckets:
                b.ordinal = ordinal
                ordinal += 1
                self._update(group, b, inv_scale, flag)
                # The cached plan keeps its buckets; not this step's grads, which would stay
                # alive (a second copy of every grad) after zero_grad(set_to_none=True).
                b.grads = []
        if leave_unscaled:
            self._unscale_grads(work, inv_scale)
        return loss

    @staticmethod
    def _unscale_grads(work, inv_scale: torch.Tensor) -> None:
        for _, buckets in work:
            for b in buckets:
                grads = [p.grad for p in b.params]
                torch._foreach_mul_(grads, inv_scale.to(grads[0].device))

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear grads; ``set_grad_none`` (Apex) picks ``None`` over zeros by default."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``torch.optim.Optimizer.state_dict()``, plus ``"rounding"`` with stochastic rounding:
        the seed and step count of its random bits (a resumed run rounds bitwise as the first)."""
        out = super().state_dict()
        if any(self.rounding(g) == "stochastic" for g in self.param_groups):
            out["rounding"] = self._rounding.state_dict()
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a checkpoint of this optimizer or of its PyTorch counterpart, all or nothing.

        The checkpoint is validated first (group sizes and hyper-parameters, every state
        tensor's size and values, step counts). ``torch.optim.Optimizer.load_state_dict``
        casts floating state to each param's dtype; the fused optimizers keep their state (and
        master weights) in fp32, so the saved fp32 tensors are put back, and group keys the
        checkpoint lacks get our defaults. The rounding of bf16 updates stays the one this
        optimizer was built with, and an O2 checkpoint's fp32 masters are kept without amp
        too (:mod:`mpnb.core.optimizers._load`).
        """
        check_loadable(self, state_dict)
        # Another optimizer class's groups are refused here, and replaced hyper-parameters named
        # after the load (amp's load hook does both when amp loads the masters).
        saved_groups = None if _load._amp_loads_masters(self) else SavedGroups(self, state_dict)
        if saved_groups is not None:
            saved_groups.check()
        rounding = state_dict.get("rounding")
        if rounding is not None and not (
            isinstance(rounding, dict)
            and all(isinstance(rounding.get(k), int) for k in ("seed", "step"))
        ):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: 'rounding' must be a dict of int "
                f"'seed' and 'step' (as state_dict() saves it), got {rounding!r}; nothing was "
                "loaded."
            )
        rounding_kept = _load.Rounding(self, state_dict)
        masters = _load.MastersWithoutAmp(self, state_dict)  # raises before any change
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
                if k == "compensation":  # Kahan's buffer is bf16 by design
                    dtype = torch.bfloat16
                state[k] = v.to(device=p.device, dtype=dtype, copy=True).contiguous()
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)
        if rounding_kept.restore() and rounding is not None:
            self._rounding = _Rounding(rounding["seed"], rounding["step"])
        self._carried = masters.apply()
        if saved_groups is not None:
            saved_groups.warn()
