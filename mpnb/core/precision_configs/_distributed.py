"""Distributed precision policies: how a model is replicated or sharded across ranks, and
which dtypes its parameters compute in and its gradients travel in.

Each policy is one :class:`DistributedConfig` object that knows itself: its strategy
(``"ddp"``: every rank holds the whole model, gradients all-reduced; ``"fsdp2"``: parameters,
gradients and optimizer state sharded 1/N per rank, parameters all-gathered for compute,
gradients reduce-scattered), its parameter and reduction dtypes, how to wrap a model
(:meth:`~DistributedConfig.wrap`, with PyTorch's own DDP and comm hooks, mpnb's amp and DDP,
or PyTorch's FSDP2 ``fully_shard`` with a ``MixedPrecisionPolicy``), how a backward runs
(:meth:`~DistributedConfig.backward`), the loss tolerance it is held to against single-process
fp32, and when a device does not offer it (:meth:`~DistributedConfig.unavailable`).

A policy is checked when it is made: one that :meth:`~DistributedConfig.wrap` could not honour
(an unknown strategy or dtype, bf16 parameters under PyTorch's DDP of an fp32 model, a
compression dtype that disagrees with the reduction dtype) raises ``ValueError`` naming the
fix. What ``wrap`` builds is one :class:`WrapPlan` (:meth:`~DistributedConfig.plan`), which
``wrap`` follows and the row's precision text is read from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mpnb.core import amp
from mpnb.core.dtype_names import short_name, torch_name
from mpnb.core.hardware import dtype_support, status_of
from mpnb.core.precision_configs._distributed_plan import (
    AMP_LEVELS,
    DTYPES,
    STRATEGIES,
    WrapPlan,
    ddp_refusal,
    tolerance_refusal,
)

__all__ = [
    "DistributedConfig",
    "WrapPlan",
    "STRATEGIES",
    "DTYPES",
    "AMP_LEVELS",
    "compress_hook",
    "shard_units",
]

#: the compression dtype -> PyTorch's comm hook that sends the gradients in it
#: (:mod:`torch.distributed.algorithms.ddp_comm_hooks.default_hooks`)
_HOOKS = {"bfloat16": "bf16_compress_hook", "float16": "fp16_compress_hook"}

#: float16's largest finite value: an fp16 reduction of a larger gradient overflows to inf
_FP16_MAX = 65504


def compress_hook(dtype_name: str) -> Callable:
    """A DDP comm hook that runs PyTorch's own ``bf16_compress_hook`` / ``fp16_compress_hook``
    (:mod:`torch.distributed.algorithms.ddp_comm_hooks.default_hooks`).

    The hooks are called, not re-implemented. The wrapper exists because
    ``DistributedDataParallel.register_comm_hook`` refuses a hook *named*
    ``bf16_compress_hook`` unless NCCL runs it, while the hook's body (cast the bucket to
    bf16, divide by the world size, all-reduce, cast back) runs on gloo as well.

    Args:
        dtype_name: ``"bfloat16"`` or ``"float16"``.
    """
    # torch's DDP comm hooks: only the compressing policies need them (+4 ms)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if dtype_name not in _HOOKS:
        raise ValueError(
            f"compress_hook: no compression hook for {dtype_name!r}; use 'bfloat16' or 'float16'."
        )
    inner = getattr(default_hooks, _HOOKS[dtype_name])

    def compress(state, bucket) -> torch.futures.Future[torch.Tensor]:
        return inner(state, bucket)

    compress.__name__ = f"mpnb_{inner.__name__}"
    # DDP checks the annotation object itself (this module's annotations are strings)
    compress.__annotations__["return"] = torch.futures.Future[torch.Tensor]
    return compress


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP2 shards one by one (each all-gathered just before its forward): every
    element of a container child (``Sequential``, ``ModuleList``, ``ModuleDict``: the
    transformer's blocks) and every other child, each when it holds parameters. The root is
    sharded after them and keeps what is left (parameters of its own)."""
    containers = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
    units = []
    for child in model.children():
        parts = list(child.children()) if isinstance(child, containers) else [child]
        units += [m for m in parts if any(True for _ in m.parameters())]
    return units


@dataclass(frozen=True)
class DistributedConfig:
    """One distributed precision policy, checked when it is made (``ValueError`` naming the
    fix for one that :meth:`wrap` could not honour).

    Attributes:
        name: its key in :data:`~mpnb.core.precision_configs.DISTRIBUTED_CONFIGS`.
        description: one line.
        strategy: ``"ddp"`` or ``"fsdp2"`` (:data:`STRATEGIES`).
        param_dtype: dtype name the forward and backward compute with (the parameters' dtype
            there: FSDP2's ``MixedPrecisionPolicy.param_dtype``, amp O2's half model copy;
            PyTorch's DDP keeps the fp32 model: ``"float32"``). One of :data:`DTYPES`; short
            names (``"bf16"``) are stored as these.
        reduce_dtype: dtype name the gradients cross the ranks in (PyTorch's DDP: the
            ``compress`` dtype, else ``"float32"``; mpnb amp: ``param_dtype``).
        compress: ``"bfloat16"``/``"float16"``: PyTorch's DDP all-reduces through PyTorch's
            compression hook of that dtype (:func:`compress_hook`); ``""``: none.
        amp_level: ``"O2"`` (:data:`AMP_LEVELS`): mpnb's ``amp.initialize`` and mpnb's DDP
            (Apex's way); ``""``: PyTorch's DDP or FSDP2.
        tolerance: max abs difference of the loss curve allowed against single-process fp32
            on the same global batch (the row's ``within_tolerance``). fp32 policies differ
            only by summation order (1e-4); a bf16 rounding of the gradients or parameters
            moves a short run's loss by about 1e-2 on the built-in workloads (2e-2 allowed).
    """

    name: str
    description: str
    strategy: str
    param_dtype: str
    reduce_dtype: str
    compress: str = ""
    amp_level: str = ""
    tolerance: float = 1e-4

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "compress"):
            value = getattr(self, field)
            if value:  # "bf16" -> "bfloat16": one spelling in the rows and the checks
                object.__setattr__(self, field, torch_name(value))
        why = self._refusal()
        if why:
            raise ValueError(f"DistributedConfig {self.name!r}: {why}")

    def _refusal(self) -> str:
        """Why :meth:`wrap` could not do what the fields say (``""``: it can)."""
        s, p, r, c, amp = (
            self.strategy, self.param_dtype, self.reduce_dtype, self.compress, self.amp_level
        )  # fmt: skip
        if s not in STRATEGIES:
            return (
                f"strategy={s!r} is unknown; use 'ddp' (every rank holds the whole model) or "
                "'fsdp2' (parameters, gradients and optimizer state sharded 1/N per rank, as "
                "ZeRO-3 does)."
            )
        for field, value in (("param_dtype", p), ("reduce_dtype", r)):
            if value not in DTYPES:
                return (
                    f"{field}={value!r} is not a dtype a policy computes or reduces in; use "
                    f"one of {', '.join(map(repr, DTYPES))} (FP8 and FP4 are single-process "
                    "recipes: compare(configs=['fp8-tensorwise', ...]) without ranks)."
                )
        if c not in ("", "bfloat16", "float16"):
            return (
                f"compress={c!r}: PyTorch's compression hooks send 'bfloat16' or 'float16'; "
                "pass one of them, or '' for none."
            )
        if amp not in ("", *AMP_LEVELS):
            return (
                f"amp_level={amp!r}: a DDP policy under mpnb amp is 'O2' (half model, fp32 "
                "master weights, half gradients all-reduced); '' trains with PyTorch's DDP or "
                "FSDP2."
            )
        if s == "fsdp2" and (c or amp):
            which = "compress" if c else "amp_level"
            return (
                f"{which} applies to DDP; FSDP2 casts through its MixedPrecisionPolicy: give "
                "param_dtype and reduce_dtype, with compress='' and amp_level=''."
            )
        if s == "ddp" and (why := ddp_refusal(p, r, c, amp)):
            return why
        return tolerance_refusal(self.tolerance)

    # ---- what it is -----------------------------------------------------------------------

    def label(self) -> str:
        """The row's name: the policy's name (the key; what ran is :meth:`precision_text`)."""
        return self.name

    def plan(self) -> WrapPlan:
        """What :meth:`wrap` builds (the fields were checked against it when the policy was
        made)."""
        if self.strategy == "fsdp2":
            return WrapPlan("fsdp2", self.param_dtype, self.reduce_dtype, "reduce-scatter")
        if self.amp_level:
            wire = self.param_dtype
            return WrapPlan("mpnb-amp-ddp", wire, wire, "all-reduce", amp_level=self.amp_level)
        hook = _HOOKS.get(self.compress, "")
        return WrapPlan("torch-ddp", "float32", self.compress or "float32", "all-reduce", hook)

    @property
    def uses_amp(self) -> bool:
        """True when a backward goes through ``amp.scale_loss`` (mpnb amp O2)."""
        return bool(self.amp_level)

    def dtypes(self) -> dict[str, torch.dtype]:
        """``{"param": torch dtype, "reduce": torch dtype}``."""
        return {
            "param": getattr(torch, self.param_dtype),
            "reduce": getattr(torch, self.reduce_dtype),
        }

    def precision_text(self) -> str:
        """``"bf16 params, fp32 reduce-scatter"``: the row's precision cell, read from
        :meth:`plan` (the collective, the dtypes on it, a compression hook, amp's masters)."""
        return self.plan().text()

    @property
    def checks_overflow(self) -> bool:
        """True when fp16 computes or carries the gradients with no loss scale to back off:
        :meth:`backward` then refuses a step whose reduced gradients overflowed (mpnb amp
        skips such steps itself)."""
        return not self.uses_amp and "float16" in (self.param_dtype, self.reduce_dtype)

    def unavailable(self, device="cpu", facts=None) -> str:
        """Why ``device`` does not offer this policy (``""``: it does).

        fp16 compression is offered only where doctor measures fp16 as native
        (:func:`mpnb.core.hardware.dtype_support`): elsewhere its all-reduce would be emulated
        arithmetic teaching nothing about the wire. ``facts``: doctor's facts, to skip measuring.
        """
        needs = {d for d in (self.param_dtype, self.reduce_dtype) if d == "float16"}
        if not needs:
            return ""

        status = status_of(dtype_support(device) if facts is None else facts, short_name("float16"))
        if status == "native":
            return ""
        return (
            f"{self.name} is not offered on {device}: fp16 is {status or 'not available'} "
            "there (doctor's facts); use the bf16 policy of the same strategy."
        )

    # ---- setting a model up ---------------------------------------------------------------

    def wrap(self, model: torch.nn.Module, make_optimizer: Callable, half_dtype=None):
        """Wrap ``model`` (an fp32 model, identical on every rank, on this rank's device) for
        this policy in the current process group; returns ``(model, optimizer)``. What it
        builds is :meth:`plan`'s ``wrapper``:

        * ``"torch-ddp"``: ``torch.nn.parallel.DistributedDataParallel``, with
          :func:`compress_hook` registered when ``compress`` is set.
        * ``"mpnb-amp-ddp"``: ``mpnb.amp.initialize(model, opt, opt_level="O2")`` (half model
          copy, fp32 master weights in the optimizer), then
          ``mpnb.parallel.DistributedDataParallel``.
        * ``"fsdp2"``: ``torch.distributed.fsdp.fully_shard`` on every unit of
          :func:`shard_units` (each block of a Sequential/ModuleList, each other child that
          holds parameters), then on the root, each with ``MixedPrecisionPolicy(param_dtype,
          reduce_dtype)``; the optimizer is built on the sharded (DTensor) parameters. Its
          ``state_dict()`` holds DTensor shards: :func:`mpnb.parallel.full_state_dict` gathers
          the full tensors a plain model loads.

        Args:
            model: the fp32 model, not yet wrapped or sharded.
            make_optimizer: ``params -> optimizer``.
            half_dtype: ignored (the policy fixes its dtypes); kept for symmetry with
                :meth:`PrecisionConfig.apply`.

        Raises:
            ValueError: ``model`` is already wrapped by a DDP or sharded by FSDP2.
        """
        # mpnb.core.parallel on first distributed use: +30 ms to importing the configurations
        from mpnb.core.parallel.distributed import wrapped_by

        already = wrapped_by(model)
        if already:
            raise ValueError(
                f"{self.name}.wrap(): the model is already wrapped by {already}; wrap() takes "
                "the plain fp32 model and wraps it once. Build a fresh model for each policy "
                "(or train the wrapped one as it is, without wrap())."
            )
        plan = self.plan()
        d = self.dtypes()
        if plan.wrapper == "fsdp2":
            # torch.distributed.fsdp: +690 ms to import, and absent from torch builds without it
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=d["param"], reduce_dtype=d["reduce"])
            for unit in shard_units(model):
                fully_shard(unit, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            return model, make_optimizer(model.parameters())
        if plan.wrapper == "mpnb-amp-ddp":
            # mpnb.core.parallel on first distributed use: +30 ms to importing the configurations
            from mpnb.core.parallel import DistributedDataParallel as MpnbDDP

            opt = make_optimizer(model.parameters())
            model, opt = amp.initialize(
                model, opt, opt_level=plan.amp_level, half_dtype=d["param"], verbosity=0
            )
            return MpnbDDP(model), opt
        ddp = TorchDDP(model)
        if plan.hook:
            ddp.register_comm_hook(None, compress_hook(plan.wire))
        return ddp, make_optimizer(ddp.parameters())

    def backward(self, loss: torch.Tensor, optimizer) -> None:
        """The backward of one step: through ``amp.scale_loss`` under mpnb amp, else
        ``loss.backward()``; then, when :attr:`checks_overflow`, the reduced gradients are
        checked.

        .. warning:: the check reads one flag on the host per step (``torch.optim``'s Python
           loops cannot skip a step on the device). Policies without fp16 read nothing.

        Raises:
            GradOverflowError: (:mod:`mpnb.parallel`) a gradient came back inf/NaN from the
                fp16 reduction or compute; the grads are dropped, so a ``step()`` after it
                changes nothing and weights and optimizer state stay as they were.
        """
        if self.uses_amp:
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            return
        loss.backward()
        if self.checks_overflow:
            self._refuse_overflow(optimizer)

    def _refuse_overflow(self, optimizer) -> None:
        # mpnb.core.parallel on first distributed use: +30 ms to importing the configurations
        from mpnb.core.parallel._common import GradOverflowError, count_nonfinite_grads

        params = [p for g in optimizer.param_groups for p in g["params"]]
        bad = count_nonfinite_grads(params, across_ranks=self.sharded())
        if not bad:
            return
        total = sum(p.grad.numel() for p in params if p.grad is not None)  # DTensor: global
        for p in params:  # torch.optim skips a param whose grad is None: the step is a no-op
            p.grad = None
        plan = self.plan()
        where = f"{short_name(plan.wire)} {plan.collective}"
        if plan.param == "float16":
            where = f"fp16 compute and {where}"
        raise GradOverflowError(
            f"policy {self.name!r}: {bad} of {total} gradient values are inf/NaN after the "
            f"{where} (fp16's largest value is {_FP16_MAX}); the step was not taken. Use the "
            "bf16 policy of the same strategy (fp32's range), or keep the gradients below "
            f"{_FP16_MAX} (a smaller learning rate, or the loss scaled down before backward)."
        )

    def sharded(self) -> bool:
        """True when each rank keeps 1/N of the parameters (FSDP2)."""
        return self.strategy == "fsdp2"
