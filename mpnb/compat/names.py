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
    "ApexPrivate",
    "MODULES",
    "NAMES",
    "PRIVATE",
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
        build_flag: the Apex build option without which a standard Apex install lacks this
            module (``"--deprecated_fused_adam"``); the alias then serves it only when asked
            (``ApexAlias(build_flags=...)``), so code that probes for it takes the path it takes
            on a standard build.
        rules: a module of :mod:`mpnb.compat` whose names (its ``__all__``) the alias serves
            instead of the home module's: the same objects configured with Apex's numerics
            where mpnb's default rounds differently (:mod:`mpnb.compat.apex_rules`).
    """

    apex: str
    mpnb: str | None
    status: str
    port: str
    note: str = ""
    build_flag: str = ""
    rules: str = ""


@dataclass(frozen=True)
class ApexName:
    """A port (and, when it differs from its module's, a status) for one Apex attribute."""

    port: str
    status: str | None = None
    note: str = ""


@dataclass(frozen=True)
class ApexPrivate:
    """An Apex internal that client code writes or calls, and what mpnb does with it.

    Attributes:
        what: the object it belongs to in Apex (``"amp._amp_state.loss_scalers[i]"``).
        status: ``provides``, ``emulates`` or ``lacks``.
        mpnb: what the write or call does in mpnb.
        port: what to write instead when porting to ``torch.amp`` / plain PyTorch.
    """

    what: str
    status: str
    mpnb: str
    port: str


_AMP_INTERNAL = "an Apex-internal module; use the public apex.amp functions"
_MEGATRON = "Megatron-Core, or torch.distributed.tensor (DTensor) / torch.distributed.pipelining"
_EXT = "an Apex CUDA extension; its Python API (or the port) instead"
_NO_TORCH = "torch has no {0}: keep {1} (mpnb's, on CPU and CUDA)"
_RULES = "mpnb.compat.apex_rules"

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
        "per optimizer: torch.optim's Adam/AdamW/SGD/Adagrad with fused=True; LAMB and NovoGrad "
        "have no torch counterpart",
        rules=_RULES,
    ),
    ApexModule(
        "apex.optimizers.fused_adam",
        "mpnb.core.optimizers.fused_adam",
        PROVIDES,
        "torch.optim.AdamW(fused=True, weight_decay=0.0) (adam_w_mode=True; AdamW's own "
        "default decay is 0.01, FusedAdam's 0) / torch.optim.Adam(fused=True)",
    ),
    ApexModule(
        "apex.optimizers.fused_sgd",
        "mpnb.core.optimizers.fused_sgd",
        PROVIDES,
        "torch.optim.SGD(fused=True)",
        rules=_RULES,
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
        rules=_RULES,
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
        rules=_RULES,
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
        "adam()/adam_mt() in torch ops with the old kernel's math (mpnb's FusedAdam is AdamW); "
        "only Apex builds made with --deprecated_fused_adam have this module, so the alias "
        "serves it only when asked: ApexAlias(build_flags={'--deprecated_fused_adam'}) or "
        "python -m mpnb.apex --deprecated_fused_adam",
        build_flag="--deprecated_fused_adam",
    ),
    ApexModule(
        "generic_scaled_masked_softmax_cuda",
        "mpnb.compat.generic_scaled_masked_softmax_cuda",
        EMULATES,
        "torch.softmax of the masked scores, times (1 - mask.all(-1)) for fully masked rows",
        "forward()/backward() on mpnb's masked softmax op (all_masked_zero=True)",
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
        "scaler = torch.amp.GradScaler(device_type) (the device is not optional: with none "
        "it means CUDA and turns itself off elsewhere); scaler.scale(loss).backward(); "
        "scaler.step(optimizer); scaler.update()"
    ),
    "apex.amp.master_params": ApexName(
        "scaler.unscale_(optimizer) first, then model.parameters() (autocast keeps fp32 "
        "params): clipping or reading the grads before unscale_ sees them x the loss scale"
    ),
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
        "torch.optim.AdamW(fused=True, weight_decay=0.0) (adam_w_mode=True; AdamW's own "
        "default decay is 0.01, FusedAdam's 0) / torch.optim.Adam(fused=True)"
    ),
    "apex.optimizers.FusedSGD": ApexName(
        "torch.optim.SGD(fused=True)",
        note="under the alias with torch.optim.SGD's rounding for half params without masters "
        "(stepwise_rounding=True), the rule Apex's tests hold it to; mpnb.optimizers.FusedSGD "
        "keeps an fp32 momentum buffer there",
    ),
    **{
        f"apex.transformer.functional.{fn}": ApexName(
            "rotary embeddings written with torch ops",
            note="under the alias rounded as Apex's kernel (cos/sin cast to the input's dtype, "
            "each product and the sum rounded to it: stepwise=True); mpnb rounds once from fp32",
        )
        for fn in (
            "fused_apply_rotary_pos_emb",
            "fused_apply_rotary_pos_emb_cached",
            "fused_apply_rotary_pos_emb_thd",
            "fused_apply_rotary_pos_emb_2d",
        )
    },
    "apex.optimizers.FusedAdagrad": ApexName("torch.optim.Adagrad(fused=True)"),
    "apex.optimizers.FusedLAMB": ApexName(_NO_TORCH.format("LAMB", "mpnb.optimizers.FusedLAMB")),
    "apex.optimizers.FusedNovoGrad": ApexName(
        _NO_TORCH.format("NovoGrad", "mpnb.optimizers.FusedNovoGrad")
    ),
    "apex.optimizers.FusedMixedPrecisionLamb": ApexName(
        _NO_TORCH.format("LAMB", "mpnb.optimizers.FusedMixedPrecisionLamb")
    ),
    "apex.parallel.LARC": ApexName(_NO_TORCH.format("LARC", "mpnb.parallel.LARC")),
    "apex.parallel.sync_batch_norm": ApexName(
        "torch.nn.SyncBatchNorm (CUDA only), or torch.nn.functional.batch_norm after an "
        "all_reduce of the statistics"
    ),
    "apex.parallel.CommStats": ApexName("torch.profiler (communication time per collective)"),
    "apex.parallel.launch": ApexName("torchrun --nproc_per_node=N"),
    "apex.parallel.RankError": ApexName("torch.distributed.elastic's ChildFailedError"),
    "apex.parallel.end_group": ApexName("torch.distributed.destroy_process_group()"),
    "apex.parallel.free_port": ApexName("torchrun --master_port (or a port of your choice)"),
    "apex.parallel.under_torchrun": ApexName("'RANK' in os.environ"),
    "apex.parallel.ReduceOp": ApexName("torch.distributed.ReduceOp"),
    "apex.parallel.distributed.apply_flat_dist_call": ApexName(
        "one torch.distributed collective per tensor"
    ),
    "apex.parallel.distributed.split_by_type": ApexName("group the tensors by t.dtype yourself"),
    "apex.parallel.distributed.split_half_float_double": ApexName(
        "group the tensors by t.dtype yourself"
    ),
    "apex.normalization.FusedLayerNorm": ApexName("torch.nn.LayerNorm"),
    "apex.normalization.FusedRMSNorm": ApexName("torch.nn.RMSNorm"),
    "apex.normalization.MixedFusedLayerNorm": ApexName("torch.nn.LayerNorm kept fp32 + autocast"),
    "apex.normalization.MixedFusedRMSNorm": ApexName("torch.nn.RMSNorm kept fp32 + autocast"),
    "apex.fp16_utils.FP16_Optimizer": ApexName("torch.autocast + torch.amp.GradScaler"),
    "apex.fp16_utils.network_to_half": ApexName("model.to(torch.float16), or torch.autocast"),
    "apex.fp16_utils.tofp16": ApexName("a module calling x.half() (or torch.autocast)"),
    "apex.fp16_utils.BN_convert_float": ApexName(
        "keep the norm layers fp32: convert only the other layers (or torch.autocast)"
    ),
    "apex.fp16_utils.convert_module": ApexName("module.to(dtype) on the layers to convert"),
    "apex.fp16_utils.convert_network": ApexName(
        "model.to(dtype), then the norm layers back to fp32 (or torch.autocast)"
    ),
    "apex.fp16_utils.prep_param_lists": ApexName(
        "[p.detach().float() for p in model.parameters()] as masters (or torch.autocast)"
    ),
    "apex.fp16_utils.model_grads_to_master_grads": ApexName(
        "torch._foreach_copy_(master_grads, model_grads) (or torch.autocast)"
    ),
    "apex.fp16_utils.master_params_to_model_params": ApexName(
        "torch._foreach_copy_(model_params, master_params) (or torch.autocast)"
    ),
    "apex.fp16_utils.to_python_float": ApexName("t.item()"),
    "apex.fp16_utils.clip_grad_norm": ApexName("torch.nn.utils.clip_grad_norm_"),
    "apex.fp16_utils.DynamicLossScaler": ApexName("torch.amp.GradScaler()"),
    "apex.fp16_utils.LossScaler": ApexName(
        "torch.amp.GradScaler(init_scale=S, growth_interval=2**31 - 1) for a static scale"
    ),
    "amp_C.multi_tensor_l2norm": ApexName("torch._foreach_norm, then torch.linalg.vector_norm"),
    "amp_C.multi_tensor_l2norm_mp": ApexName(
        "torch._foreach_norm, then torch.linalg.vector_norm (skip when the step is skipped)"
    ),
    "amp_C.multi_tensor_l2norm_scale": ApexName(
        "torch._foreach_norm for the norm, torch._foreach_mul for the scaled copy"
    ),
    "amp_C.multi_tensor_unscale_l2norm": ApexName(
        "torch._foreach_norm of torch._foreach_mul(grads, inv_scale)"
    ),
    "amp_C.multi_tensor_scale": ApexName("torch._foreach_mul"),
    "amp_C.multi_tensor_axpby": ApexName(
        "torch._foreach_add(torch._foreach_mul(x, a), y, alpha=b)"
    ),
    "amp_C.multi_tensor_check_finite": ApexName(
        "torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, ones)"
    ),
    "amp_C.update_scale_hysteresis": ApexName("torch.amp.GradScaler.update() (no hysteresis)"),
    "amp_C.multi_tensor_adam": ApexName("torch.optim.Adam(fused=True)"),
    "amp_C.multi_tensor_adam_capturable": ApexName("torch.optim.Adam(fused=True, capturable=True)"),
    "amp_C.multi_tensor_adam_capturable_master": ApexName(
        "torch.optim.Adam(fused=True, capturable=True) on fp32 params under torch.autocast"
    ),
    "amp_C.multi_tensor_sgd": ApexName("torch.optim.SGD(fused=True)"),
    "amp_C.multi_tensor_adagrad": ApexName("torch.optim.Adagrad(fused=True)"),
    "amp_C.multi_tensor_novograd": ApexName(
        _NO_TORCH.format("NovoGrad", "mpnb.optimizers.FusedNovoGrad")
    ),
    **{
        f"amp_C.multi_tensor_{fn}": ApexName(_NO_TORCH.format("LAMB", f"mpnb.optimizers.{lamb}"))
        for fn, lamb in (
            ("lamb", "FusedLAMB"),
            ("lamb_mp", "FusedMixedPrecisionLamb"),
            ("lamb_stage1_cuda", "FusedLAMB"),
            ("lamb_stage2_cuda", "FusedLAMB"),
        )
    },
    "apex_C.flatten": ApexName("torch._utils._flatten_dense_tensors"),
    "apex_C.unflatten": ApexName("torch._utils._unflatten_dense_tensors"),
}
"""Ports (and statuses that differ from their module's) of single Apex names."""


_SCALER = "amp._amp_state.loss_scalers[i] (Apex's LossScaler)"

PRIVATE: dict[str, ApexPrivate] = {
    "_loss_scale": ApexPrivate(
        _SCALER,
        EMULATES,
        "sets the scaler's current scale (through LossScaler.load_state_dict)",
        "torch.amp.GradScaler(init_scale=...)",
    ),
    "_scale_seq_len": ApexPrivate(
        _SCALER,
        EMULATES,
        "sets the scaler's scale_window (growth_interval): clean steps between two growths",
        "torch.amp.GradScaler(growth_interval=...)",
    ),
    "_max_loss_scale": ApexPrivate(
        _SCALER,
        EMULATES,
        "sets the scaler's max_loss_scale (the upper clamp)",
        "torch.amp.GradScaler has no upper clamp; amp.initialize(max_loss_scale=...)",
    ),
    "_min_loss_scale": ApexPrivate(
        _SCALER,
        EMULATES,
        "sets the scaler's min_loss_scale (the lower clamp)",
        "torch.amp.GradScaler has no lower clamp; amp.initialize(min_loss_scale=...)",
    ),
    "_unskipped": ApexPrivate(
        _SCALER,
        EMULATES,
        "sets the clean steps counted towards the next growth (LossScaler.load_state_dict)",
        "scaler.load_state_dict(state) of a torch.amp.GradScaler",
    ),
    "_amp_stash": ApexPrivate(
        "optimizer (set by amp.initialize)",
        LACKS,
        "read-only: amp.initialize sets optimizer._amp_stash, a view of amp's state",
        "nothing: torch.amp keeps no state on the optimizer",
    ),
    "_amp_stash.lazy_init_called": ApexPrivate(
        "optimizer._amp_stash",
        EMULATES,
        "True is accepted: mpnb's masters need no lazy set-up (False is refused)",
        "delete it: torch.autocast keeps fp32 params, no masters to set up",
    ),
    "_amp_stash.*": ApexPrivate(
        "optimizer._amp_stash",
        LACKS,
        "read-only: optimizer._amp_stash is a view of amp's state",
        "nothing: torch.amp keeps no state on the optimizer",
    ),
    "_lazy_init_maybe_master_weights()": ApexPrivate(
        "optimizer (patched by amp.initialize)",
        EMULATES,
        "a call into amp: the fp32 masters are set up for this optimizer now (mpnb makes them "
        "in amp.initialize and they follow the model until the first step)",
        "delete it: torch.autocast keeps fp32 params, no masters to set up",
    ),
}
"""The Apex internals client code writes (``x._scale_seq_len = 64``) or calls
(``optimizer._lazy_init_maybe_master_weights()``), by attribute: ``"_amp_stash.<attr>"`` is a
write through ``optimizer._amp_stash``, ``"name()"`` a call. ``--check`` reports each use."""


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
