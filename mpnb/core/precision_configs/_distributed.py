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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mpnb.core.dtype_names import short_name

__all__ = ["DistributedConfig", "STRATEGIES", "compress_hook", "shard_units"]

#: the strategies a policy may have, in table order
STRATEGIES = ("ddp", "fsdp2")


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
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = {
        "bfloat16": default_hooks.bf16_compress_hook,
        "float16": default_hooks.fp16_compress_hook,
    }
    if dtype_name not in hook:
        raise ValueError(
            f"compress_hook: no compression hook for {dtype_name!r}; use 'bfloat16' or 'float16'."
        )
    inner = hook[dtype_name]

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
    """One distributed precision policy.

    Attributes:
        name: its key in :data:`~mpnb.core.precision_configs.DISTRIBUTED_CONFIGS`.
        description: one line.
        strategy: ``"ddp"`` or ``"fsdp2"``.
        param_dtype: dtype name the forward and backward compute with (the parameters' dtype
            there: FSDP2's ``MixedPrecisionPolicy.param_dtype``, amp O2's half model copy).
        reduce_dtype: dtype name the gradients cross the ranks in.
        compress: ``"bfloat16"``/``"float16"``: DDP all-reduces through PyTorch's compression
            hook of that dtype (:func:`compress_hook`); ``""``: none.
        amp_level: ``"O2"``: mpnb's ``amp.initialize`` and mpnb's DDP (Apex's way); ``""``:
            PyTorch's DDP or FSDP2.
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

    # ---- what it is -----------------------------------------------------------------------

    def label(self) -> str:
        """The row's name: the policy's name (it says the strategy and the dtypes)."""
        return self.name

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
        """``"bf16 params, fp32 reduce"``: the row's precision cell."""
        p, r = short_name(self.param_dtype), short_name(self.reduce_dtype)
        return f"{p} params, {r} reduce"

    def unavailable(self, device="cpu", facts=None) -> str:
        """Why ``device`` does not offer this policy (``""``: it does).

        fp16 compression is offered only where doctor measures fp16 as native
        (:func:`mpnb.core.hardware.dtype_support`): elsewhere its all-reduce would be emulated
        arithmetic teaching nothing about the wire. ``facts``: doctor's facts, to skip measuring.
        """
        needs = {d for d in (self.param_dtype, self.reduce_dtype) if d == "float16"}
        if not needs:
            return ""
        from mpnb.core.hardware import dtype_support, status_of

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
        this policy in the current process group; returns ``(model, optimizer)``.

        * DDP: ``torch.nn.parallel.DistributedDataParallel``, with :func:`compress_hook`
          registered when ``compress`` is set.
        * mpnb amp O2: ``mpnb.amp.initialize(model, opt, opt_level="O2")`` (half model copy,
          fp32 master weights in the optimizer), then ``mpnb.parallel.DistributedDataParallel``.
        * FSDP2: ``torch.distributed.fsdp.fully_shard`` on every unit of
          :func:`shard_units` (each block of a Sequential/ModuleList, each other child that
          holds parameters), then on the root, each with ``MixedPrecisionPolicy(param_dtype,
          reduce_dtype)``; the optimizer is built on the sharded (DTensor) parameters.

        Args:
            model: the fp32 model.
            make_optimizer: ``params -> optimizer``.
            half_dtype: ignored (the policy fixes its dtypes); kept for symmetry with
                :meth:`PrecisionConfig.apply`.
        """
        if self.strategy == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            d = self.dtypes()
            mp = MixedPrecisionPolicy(param_dtype=d["param"], reduce_dtype=d["reduce"])
            for unit in shard_units(model):
                fully_shard(unit, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            return model, make_optimizer(model.parameters())
        if self.amp_level:
            from mpnb.core import amp
            from mpnb.core.parallel import DistributedDataParallel as MpnbDDP

            opt = make_optimizer(model.parameters())
            model, opt = amp.initialize(
                model,
                opt,
                opt_level=self.amp_level,
                half_dtype=self.dtypes()["param"],
                verbosity=0,
            )
            return MpnbDDP(model), opt
        from torch.nn.parallel import DistributedDataParallel as TorchDDP

        ddp = TorchDDP(model)
        if self.compress:
            ddp.register_comm_hook(None, compress_hook(self.compress))
        return ddp, make_optimizer(ddp.parameters())

    def backward(self, loss: torch.Tensor, optimizer) -> None:
        """The backward of one step: through ``amp.scale_loss`` under mpnb amp, else
        ``loss.backward()``."""
        if self.uses_amp:
            from mpnb.core import amp

            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        else:
            loss.backward()

    def sharded(self) -> bool:
        """True when each rank keeps 1/N of the parameters (FSDP2)."""
        return self.strategy == "fsdp2"
