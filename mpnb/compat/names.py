"""Every Apex module name, where it lives in mpnb, and its ``torch.amp`` / ``torch`` port.

This table is the one place that says what each Apex name is in mpnb. Three things read it:

* the import alias (:mod:`mpnb.compat.alias`): ``import apex.X`` gives the module listed here;
* the migration report (``python -m mpnb.apex --check SCRIPT``, :mod:`mpnb.compat.check`);
* the Apex-named top-level modules (``mpnb.amp``, ``mpnb.parallel``, ...): each is the same two
  lines, ``from mpnb.core.<path> import *`` and its ``__all__``, and a test holds every module
  of this table whose home is ``mpnb.<path>`` to that pattern.

Statuses:

* ``provides``: mpnb implements it, with Apex's names and behaviour.
* ``emulates``: Apex's surface over a different mechanism (a read-only view onto mpnb's state,
  an extension module's functions rebuilt on mpnb's ops); the note says what differs.
* ``lacks``: not in mpnb; the port says what to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "PROVIDES",
    "EMULATES",
    "LACKS",
    "ApexModule",
    "ApexName",
    "MODULES",
    "NAMES",
    "top_level_modules",
]

PROVIDES, EMULATES, LACKS = "provides", "emulates", "lacks"


@dataclass(frozen=True)
class ApexModule:
    """One Apex module: its name, its mpnb home (None when lacking), status and port.

    Attributes:
        apex: the name Apex code imports (``"apex.amp"``, ``"amp_C"``).
        mpnb: the mpnb module that stands for it, or None.
        status: ``provides``, ``emulates`` or ``lacks``.
        port: what to use when porting the code to ``torch.amp`` / plain PyTorch.
        note: what differs from Apex, or why it is missing.
    """

    apex: str
    mpnb: str | None
    status: str
    port: str
    note: str = ""


@dataclass(frozen=True)
class ApexName:
    """A port (and, when it differs from its module's, a status) for one Apex attribute."""

    port: str
    status: str | None = None
    note: str = ""


_AMP_INTERNAL = "an Apex-internal module; use the public apex.amp functions"
_MEGATRON = "Megatron-Core, or torch.distributed.tensor (DTensor) / torch.distributed.pipelining"
_EXT = "an Apex CUDA extension; its Python API (or the port) instead"

_ROWS = [
    # the packages
    ApexModule("apex", "mpnb", PROVIDES, "torch.amp, torch.nn.parallel, torch.optim"),
    ApexModule("apex.amp", "mpnb.amp", PROVIDES, "torch.autocast + torch.amp.GradScaler"),
    ApexModule(
        "apex.amp._amp_state",
        "mpnb.compat.amp_state",
        EMULATES,
        "torch.amp.GradScaler.get_scale()",
        "a read-only view onto mpnb.amp.current_handle(): loss_scalers, opt_properties, handle",
    ),
    ApexModule(
        "apex.amp.scaler",
        "mpnb.core.amp.scaler",
        EMULATES,
        "torch.amp.GradScaler",
        "mpnb's LossScaler: loss_scale() and state_dict() as in Apex, other methods mpnb's",
    ),
    *(
        ApexModule(f"apex.amp.{m}", None, LACKS, "the public apex.amp names", _AMP_INTERNAL)
        for m in (
            "handle",
            "frontend",
            "_initialize",
            "_process_optimizer",
            "amp",
            "opt",
            "utils",
            "wrap",
            "lists",
        )
    ),
    ApexModule(
        "apex.fp16_utils",
        "mpnb.fp16_utils",
        PROVIDES,
        "torch.autocast + torch.amp.GradScaler",
    ),
    ApexModule(
        "apex.fp16_utils.fp16_optimizer",
        "mpnb.core.fp16_utils.fp16_optimizer",
        PROVIDES,
        "torch.autocast + torch.amp.GradScaler",
    ),
    ApexModule(
        "apex.fp16_utils.fp16util",
        "mpnb.core.fp16_utils.fp16util",
        PROVIDES,
        "model.to(dtype); torch.nn.utils.clip_grad_norm_",
    ),
    ApexModule(
        "apex.fp16_utils.loss_scaler",
        "mpnb.core.fp16_utils.loss_scaler",
        PROVIDES,
        "torch.amp.GradScaler",
    ),
    ApexModule(
        "apex.fused_dense",
        "mpnb.fused_dense",
        PROVIDES,
        "torch.nn.Linear (torch.compile fuses the bias and GELU)",
    ),
    ApexModule(
        "apex.fused_dense.fused_dense",
        "mpnb.core.fused_dense",
        PROVIDES,
        "torch.nn.Linear (torch.compile fuses the bias and GELU)",
    ),
    ApexModule("apex.mlp", "mpnb.mlp", PROVIDES, "torch.nn.Sequential of Linear and activations"),
    ApexModule(
        "apex.mlp.mlp", "mpnb.core.mlp", PROVIDES, "torch.nn.Sequential of Linear and activations"
    ),
    ApexModule(
        "apex.multi_tensor_apply", "mpnb.multi_tensor_apply", PROVIDES, "torch._foreach_* ops"
    ),
    ApexModule(
        "apex.multi_tensor_apply.multi_tensor_apply",
        "mpnb.core.multi_tensor_apply",
        PROVIDES,
        "torch._foreach_* ops",
    ),
    ApexModule(
        "apex.normalization",
        "mpnb.normalization",
        PROVIDES,
        "torch.nn.LayerNorm / torch.nn.RMSNorm",
    ),
    ApexModule(
        "apex.normalization.fused_layer_norm",
        "mpnb.compat.fused_layer_norm",
        EMULATES,
        "torch.nn.functional.layer_norm / rms_norm",
        "mpnb's modules and functions; the *Function classes' apply() runs the same ops",
    ),
    ApexModule(
        "apex.optimizers",
        "mpnb.optimizers",
        PROVIDES,
        "torch.optim with fused=True (Adam, AdamW, SGD, Adagrad)",
    ),
    ApexModule(
        "apex.optimizers.fused_adam",
        "mpnb.core.optimizers.fused_adam",
        PROVIDES,
        "torch.optim.AdamW(fused=True) (adam_w_mode=True) / torch.optim.Adam(fused=True)",
    ),
    ApexModule(
        "apex.optimizers.fused_sgd",
        "mpnb.core.optimizers.fused_sgd",
        PROVIDES,
        "torch.optim.SGD(fused=True)",
    ),
    ApexModule(
        "apex.optimizers.fused_adagrad",
        "mpnb.core.optimizers.fused_adagrad",
        PROVIDES,
        "torch.optim.Adagrad(fused=True)",
    ),
    ApexModule(
        "apex.optimizers.fused_lamb",
        "mpnb.core.optimizers.fused_lamb",
        PROVIDES,
        "no LAMB in torch.optim: keep mpnb.optimizers.FusedLAMB",
    ),
    ApexModule(
        "apex.optimizers.fused_novograd",
        "mpnb.core.optimizers.fused_novograd",
        PROVIDES,
        "no NovoGrad in torch.optim: keep mpnb.optimizers.FusedNovoGrad",
    ),
    ApexModule(
        "apex.optimizers.fused_mixed_precision_lamb",
        "mpnb.core.optimizers.fused_mixed_precision_lamb",
        PROVIDES,
        "no LAMB in torch.optim: keep mpnb.optimizers.FusedMixedPrecisionLamb",
    ),
    ApexModule(
        "apex.parallel",
        "mpnb.parallel",
        PROVIDES,
        "torch.nn.parallel.DistributedDataParallel + torch.nn.SyncBatchNorm",
    ),
    ApexModule(
        "apex.parallel.distributed",
        "mpnb.core.parallel.distributed",
        PROVIDES,
        "torch.nn.parallel.DistributedDataParallel; torch.distributed collectives",
    ),
    ApexModule(
        "apex.parallel.LARC",
        "mpnb.core.parallel.larc",
        PROVIDES,
        "no LARC in torch.optim: keep mpnb.parallel.LARC",
    ),
    *(
        ApexModule(
            f"apex.parallel.{m}",
            "mpnb.core.parallel.sync_batchnorm",
            PROVIDES,
            "torch.nn.SyncBatchNorm (CUDA only)",
        )
        for m in ("sync_batchnorm", "optimized_sync_batchnorm")
    ),
    *(
        ApexModule(
            f"apex.parallel.{m}",
            "mpnb.core.parallel.sync_batchnorm_kernel",
            EMULATES,
            "torch.nn.SyncBatchNorm (CUDA only)",
            "SyncBatchnormFunction takes mpnb's argument order; call sync_batch_norm",
        )
        for m in ("sync_batchnorm_kernel", "optimized_sync_batchnorm_kernel")
    ),
    ApexModule(
        "apex.parallel.multiproc",
        None,
        LACKS,
        "torchrun --nproc_per_node=N (or mpnb.parallel.launch)",
        "Apex's old one-process-per-GPU launcher",
    ),
    ApexModule(
        "apex.transformer",
        "mpnb.transformer",
        PROVIDES,
        "torch.nn.functional.scaled_dot_product_attention",
        "the fused-kernel parts (enums, functional); not tensor/pipeline parallelism",
    ),
    ApexModule("apex.transformer.enums", "mpnb.transformer.enums", PROVIDES, "your own enum"),
    ApexModule(
        "apex.transformer.functional",
        "mpnb.transformer.functional",
        PROVIDES,
        "torch.softmax under autocast; RoPE in torch ops",
    ),
    ApexModule(
        "apex.transformer.functional.fused_softmax",
        "mpnb.transformer.functional.fused_softmax",
        PROVIDES,
        "torch.softmax under autocast, or torch.nn.functional.scaled_dot_product_attention",
    ),
    ApexModule(
        "apex.transformer.functional.fused_rope",
        "mpnb.transformer.functional.fused_rope",
        PROVIDES,
        "rotary embeddings written with torch ops",
    ),
    *(
        ApexModule(f"apex.transformer.{m}", None, LACKS, _MEGATRON, "Megatron's model parallelism")
        for m in (
            "tensor_parallel",
            "pipeline_parallel",
            "parallel_state",
            "layers",
            "microbatches",
            "amp",
            "utils",
            "testing",
            "log_util",
            "_data",
        )
    ),
    ApexModule(
        "apex.contrib",
        None,
        LACKS,
        "per feature: torch.optim, scaled_dot_product_attention, torch.compile",
        "mpnb re-implements Apex's core packages, not apex.contrib",
    ),
    ApexModule("apex.RNN", None, LACKS, "torch.nn.LSTM / torch.nn.GRU under autocast"),
    ApexModule(
        "apex.reparameterization",
        None,
        LACKS,
        "torch.nn.utils.parametrizations.weight_norm",
    ),
    ApexModule("apex.pyprof", None, LACKS, "torch.profiler"),
    # Apex's compiled extension modules, imported by their own top-level names
    ApexModule(
        "amp_C",
        "mpnb.amp_C",
        PROVIDES,
        "torch._foreach_* and torch._amp_foreach_non_finite_check_and_unscale_",
    ),
    ApexModule(
        "apex_C",
        "mpnb.compat.apex_C",
        EMULATES,
        "torch._utils._flatten_dense_tensors / _unflatten_dense_tensors",
        "flatten/unflatten on torch's own helpers",
    ),
    ApexModule(
        "fused_adam_cuda",
        "mpnb.compat.fused_adam_cuda",
        EMULATES,
        "torch.optim.Adam(fused=True)",
        "adam()/adam_mt() in torch ops with the old kernel's math (mpnb's FusedAdam is AdamW)",
    ),
    ApexModule(
        "fused_layer_norm_cuda",
        "mpnb.compat.fused_layer_norm_cuda",
        EMULATES,
        "torch.nn.functional.layer_norm / rms_norm",
        "on mpnb's norm ops; the mixed-dtype forms return the input's dtype (Apex: weight's)",
    ),
    ApexModule(
        "syncbn",
        "mpnb.compat.syncbn",
        EMULATES,
        "torch.nn.SyncBatchNorm (CUDA only)",
        "the Welford and batch-norm kernels on mpnb's SyncBatchNorm steps",
    ),
    *(
        ApexModule(ext, None, LACKS, port, _EXT)
        for ext, port in (
            ("mlp_cuda", "apex.mlp"),
            ("fused_dense_cuda", "apex.fused_dense"),
            ("scaled_masked_softmax_cuda", "apex.transformer.functional.fused_softmax"),
            ("scaled_upper_triang_masked_softmax_cuda", "apex.transformer.functional"),
            ("generic_scaled_masked_softmax_cuda", "apex.transformer.functional"),
            ("scaled_softmax_cuda", "apex.transformer.functional"),
            ("fused_rotary_positional_embedding", "apex.transformer.functional.fused_rope"),
            ("fused_weight_gradient_mlp_cuda", "apex.fused_dense"),
            ("distributed_adam_cuda", "torch.distributed.optim.ZeroRedundancyOptimizer / FSDP"),
            ("distributed_lamb_cuda", "torch.distributed.optim.ZeroRedundancyOptimizer / FSDP"),
            ("xentropy_cuda", "torch.nn.functional.cross_entropy(label_smoothing=...)"),
            ("fast_multihead_attn", "torch.nn.functional.scaled_dot_product_attention"),
        )
    ),
]

MODULES: dict[str, ApexModule] = {row.apex: row for row in _ROWS}
"""Every Apex module name mpnb knows, by name."""

NAMES: dict[str, ApexName] = {
    "apex.amp.initialize": ApexName(
        "delete it: run forward and loss under torch.autocast(device_type, dtype); "
        "O2/O3 model casts are model.to(dtype)"
    ),
    "apex.amp.scale_loss": ApexName(
        "scaler = torch.amp.GradScaler(); scaler.scale(loss).backward(); "
        "scaler.step(optimizer); scaler.update()"
    ),
    "apex.amp.master_params": ApexName("model.parameters() (autocast keeps fp32 params)"),
    "apex.amp.state_dict": ApexName("scaler.state_dict()"),
    "apex.amp.load_state_dict": ApexName("scaler.load_state_dict(state)"),
    "apex.amp.disable_casts": ApexName("with torch.autocast(device_type, enabled=False):"),
    "apex.amp.init": ApexName("torch.autocast (Apex's pre-initialize API)"),
    **{
        f"apex.amp.{fn}": ApexName("torch.amp.custom_fwd(cast_inputs=dtype) or explicit casts")
        for fn in (
            "half_function",
            "float_function",
            "promote_function",
            "register_half_function",
            "register_float_function",
            "register_promote_function",
        )
    },
    "apex.amp._amp_state.loss_scalers": ApexName("scaler.get_scale()"),
    "apex.amp._amp_state.opt_properties": ApexName("your own training config"),
    "apex.parallel.DistributedDataParallel": ApexName(
        "torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])"
    ),
    "apex.parallel.SyncBatchNorm": ApexName("torch.nn.SyncBatchNorm (CUDA only)"),
    "apex.parallel.convert_syncbn_model": ApexName(
        "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) (CUDA only)"
    ),
    "apex.parallel.Reducer": ApexName("torch.distributed.all_reduce over the gradients"),
    "apex.parallel.distributed.flat_dist_call": ApexName(
        "one torch.distributed collective per tensor"
    ),
    "apex.optimizers.FusedAdam": ApexName(
        "torch.optim.AdamW(fused=True) (adam_w_mode=True) / torch.optim.Adam(fused=True)"
    ),
    "apex.optimizers.FusedSGD": ApexName("torch.optim.SGD(fused=True)"),
    "apex.optimizers.FusedAdagrad": ApexName("torch.optim.Adagrad(fused=True)"),
    "apex.normalization.FusedLayerNorm": ApexName("torch.nn.LayerNorm"),
    "apex.normalization.FusedRMSNorm": ApexName("torch.nn.RMSNorm"),
    "apex.normalization.MixedFusedLayerNorm": ApexName("torch.nn.LayerNorm kept fp32 + autocast"),
    "apex.normalization.MixedFusedRMSNorm": ApexName("torch.nn.RMSNorm kept fp32 + autocast"),
    "apex.fp16_utils.FP16_Optimizer": ApexName("torch.autocast + torch.amp.GradScaler"),
    "apex.fp16_utils.network_to_half": ApexName("model.to(torch.float16), or torch.autocast"),
    "amp_C.multi_tensor_l2norm": ApexName("torch._foreach_norm, then torch.linalg.vector_norm"),
    "amp_C.multi_tensor_scale": ApexName("torch._foreach_mul"),
    "amp_C.multi_tensor_adam": ApexName("torch.optim.Adam(fused=True)"),
    "amp_C.multi_tensor_sgd": ApexName("torch.optim.SGD(fused=True)"),
    "apex_C.flatten": ApexName("torch._utils._flatten_dense_tensors"),
    "apex_C.unflatten": ApexName("torch._utils._unflatten_dense_tensors"),
}
"""Ports (and statuses that differ from their module's) of single Apex names."""


def top_level_modules() -> dict[str, str]:
    """The Apex-named top-level mpnb modules and the ``mpnb.core`` module each re-exports.

    Example::

        >>> top_level_modules()["mpnb.amp"]
        'mpnb.core.amp'
    """
    out = {}
    for row in MODULES.values():
        m = row.mpnb
        if m and m != "mpnb" and not m.startswith(("mpnb.core.", "mpnb.compat.")):
            out[m] = "mpnb.core." + m[len("mpnb.") :]
    return out
