"""``mpnb.lab.distributed``: precision policies compared on N ranks (DDP and FSDP2).

:func:`mpnb.lab.compare` with ``ranks=N`` (N >= 2) trains the workload on N local ranks
(:func:`mpnb.core.parallel.launch`, gloo on CPU, nccl on CUDA) under each distributed policy of
:data:`mpnb.core.precision_configs.DISTRIBUTED_CONFIGS` and returns one row per policy with
today's columns where they make sense plus :data:`DIST_COLUMNS`.

``python -m mpnb.lab.distributed`` runs the same comparison as a plain script, unchanged under
``torchrun`` (it reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` when torchrun started it).
"""

from __future__ import annotations

__all__ = ["DIST_COLUMNS"]

#: The columns a distributed comparison adds, each with what it holds (name -> description).
#: Iterating gives the names in table order.
DIST_COLUMNS: dict[str, str] = {
    "ranks": "int: the number of ranks (processes) the policy was trained on.",
    "strategy": '"ddp" or "fsdp2": how the model is replicated or sharded across ranks.',
    "policy": 'the policy\'s name, a key of DISTRIBUTED_CONFIGS (e.g. "fsdp2-bf16-reduce").',
    "param_dtype": 'dtype name of the parameters the forward/backward compute with ("float32").',
    "reduce_dtype": 'dtype name the gradients travel in across ranks ("bfloat16" for bf16 '
    "compression or bf16 reduction).",
    "mem_sharded_params_mib": "MiB per rank (max over ranks) of the parameter storage a rank "
    "keeps between steps: its 1/N shard under FSDP2 (padded), the whole model under DDP "
    "(mpnb amp O2: the bf16 model copy; its fp32 masters count as optimizer state); the "
    "storages of model.parameters(), local shards for DTensors.",
    "mem_unsharded_params_mib": "MiB per rank (max over ranks) of the unsharded parameter "
    "parameters FSDP2 all-gathers for compute (in param_dtype): the peak, sampled in a forward "
    "pre-hook on every module and after backward; 0 under DDP.",
    "mem_grads_mib": "MiB per rank (max over ranks) of gradient storage after backward "
    "(sharded under FSDP2); DDP's bucket buffers are not counted.",
    "mem_optimizer_mib": "MiB per rank (max over ranks) of optimizer state storages (e.g. "
    "Adam's exp_avg/exp_avg_sq, local shards under FSDP2) found through optimizer.state, and "
    "the fp32 master weights the optimizer updates in place of the model's (mpnb amp O2).",
    "mem_activations_mib": "MiB per rank (max over ranks): tensors saved for backward during "
    "the forward (torch.autograd.graph.saved_tensors_hooks, unique storages).",
    "mem_peak_mib": "MiB per rank (max over ranks): the largest sum of the roles above seen "
    "at the sampling points of a measured step (every module's forward, the end of backward, "
    "after the optimizer step).",
    "bytes_sent_per_step": "int: bytes a rank sends per step (mean over ranks), counted at the "
    "collectives (every c10d collective the process group runs, those issued from C++ by DDP's "
    "reducer and FSDP2 included), by the ring algorithm's per-rank traffic.",
    "bytes_recv_per_step": "int: bytes a rank receives per step (mean over ranks), counted "
    "like bytes_sent_per_step.",
    "bytes_by_op": 'dict: collective name ("all_reduce", "all_gather", "reduce_scatter", '
    '"broadcast", ...) -> bytes sent per rank per step.',
    "comm_s": "seconds per step with at least one collective in flight (issue to completion "
    "of its Work), median over the measured (untimed) steps, rank 0.",
    "step_ms": "ms per step: median over the timed rounds (policies timed round-robin, one "
    "step of each per round, as the single-process lab does); max over ranks per step.",
    "step_ms_lo": "lower end of a 95% bootstrap interval of step_ms's median.",
    "step_ms_hi": "upper end of a 95% bootstrap interval of step_ms's median.",
    "loss_final": "the last step's training loss (mean over ranks of the rank's shard loss, "
    "i.e. the global-batch loss).",
    "loss_vs_fp32": "max abs difference of the loss curve against the single-process fp32 run "
    "on the same global batch.",
    "tolerance": "the policy's stated tolerance on loss_vs_fp32 (from its dtypes).",
    "within_tolerance": "bool: loss_vs_fp32 <= tolerance.",
    "flops_per_step": "model FLOPs per step per rank, as the single-process lab counts them.",
    "status": '"ok", "error", "hung", "interrupted" (another policy\'s failure, Ctrl-C or '
    'SIGTERM ended the run first: the steps before are kept) or "skipped" (not offered on '
    "this device).",
    "error": "what went wrong, naming the rank and the policy; empty when ok.",
}
