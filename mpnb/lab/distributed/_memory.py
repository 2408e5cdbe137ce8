"""Memory per rank by role, measured from the tensors themselves.

On CPU there is no allocator counter per role, so :class:`RoleMeter` finds the tensors of each
role and sums their storages (unique by data pointer, so views and shared storages count once):

* **sharded params**: the parameters a rank keeps between steps, read right after wrapping:
  the local shard of each FSDP2 ``DTensor`` parameter (``to_local()``), the whole parameter
  under DDP (amp O2: the bf16 model copy).
* **unsharded params**: parameters that are plain tensors while FSDP2 has a module unsharded
  (``fully_shard`` swaps the all-gathered tensors in as the module's parameters for its
  forward and backward): sampled in a forward pre-hook on every module (registered after
  ``fully_shard``'s, so it runs once the all-gather is done) and after backward; the peak.
* **grads**: the storages of every parameter's ``.grad`` after backward (FSDP2: the local
  shards; amp O2: the model's bf16 grads and the fp32 master grads).
* **optimizer state**: every tensor in ``optimizer.state`` (local shards), plus the
  parameters the optimizer updates that are not the model's (amp O2's fp32 master weights).
* **activations**: tensors autograd saves for backward during the forward
  (``torch.autograd.graph.saved_tensors_hooks``), excluding parameter storages.
* **peak**: the largest sum of the roles at the sampling points (every module's forward, the
  end of backward, after the optimizer step). Not the allocator's peak: every policy shares
  the rank's process, so ``torch.cuda.max_memory_allocated`` would mix them; and workspace
  buffers (DDP's buckets, the collectives' staging) are not counted.
"""

from __future__ import annotations

import torch

__all__ = ["RoleMeter", "storage_bytes", "MIB"]

MIB = 2**20


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors, exclude: set | None = None) -> int:
    """Bytes of the unique storages behind ``tensors`` (DTensors: their local shard)."""
    seen, total = set(exclude or ()), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        st = _local(t).untyped_storage()
        key = st.data_ptr()
        if key in seen or st.nbytes() == 0:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def _state_tensors(optimizer):
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v


class RoleMeter:
    """Measures one wrapped model's memory by role (see the module); one per policy per rank.

    Args:
        model: the wrapped model (DDP, FSDP2 or amp O2 + mpnb DDP).
        optimizer: its optimizer.
        sharded: True for FSDP2 (plain-tensor parameters then are all-gathered ones).
    """

    def __init__(self, model: torch.nn.Module, optimizer, sharded: bool) -> None:
        self.model, self.optimizer, self.sharded = model, optimizer, sharded
        self.params_bytes = storage_bytes(model.parameters())
        self.unsharded = self.grads = self.optim = self.acts = self.peak = 0
        self._acts_now = 0
        self._seen: set[int] = set()
        self._measuring = False
        self._handles = [m.register_forward_pre_hook(self._on_forward) for m in model.modules()]

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()

    def _unsharded_now(self) -> int:
        if not self.sharded:
            return 0
        plain = [p for p in self.model.parameters() if not hasattr(p, "to_local")]
        return storage_bytes(plain)

    def _param_ptrs(self) -> set:
        return {_local(p).untyped_storage().data_ptr() for p in self.model.parameters()}

    def _sample(self, grads: int = 0) -> None:
        u = self._unsharded_now()
        self.unsharded = max(self.unsharded, u)
        total = self.params_bytes + u + self._acts_now + grads + self._optim_now()
        self.peak = max(self.peak, total)

    def _optim_now(self) -> int:
        mine = self._param_ptrs()
        masters = [
            p
            for g in self.optimizer.param_groups
            for p in g["params"]
            if _local(p).untyped_storage().data_ptr() not in mine
        ]
        return storage_bytes([*_state_tensors(self.optimizer), *masters], exclude=mine)

    def _on_forward(self, module, args) -> None:
        if self._measuring:
            self._sample()

    def _pack(self, t: torch.Tensor):
        if self._measuring and isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            key = st.data_ptr()
            if key not in self._seen and key not in self._params:
                self._seen.add(key)
                self._acts_now += st.nbytes()
        return t

    def forward(self):
        """Context for the forward of a measured step: counts the tensors saved for backward."""
        self._measuring, self._acts_now, self._seen = True, 0, set()
        self._params = self._param_ptrs()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def after_backward(self) -> None:
        """Sample after backward (grads present, activations freed)."""
        self.acts = max(self.acts, self._acts_now)
        self._acts_now = 0
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        params += list(self.model.parameters())
        g = storage_bytes(p.grad for p in params if p.grad is not None)
        self.grads = max(self.grads, g)
        self._sample(g)

    def after_step(self) -> None:
        """Sample after the optimizer step (optimizer state exists from the first step)."""
        self.optim = max(self.optim, self._optim_now())
        self._sample()
        self._measuring = False

    def mib(self) -> dict:
        """The roles in MiB, as the rows' ``mem_*_mib`` columns."""
        # the policies share each rank's process (round-robin), so the allocator's own peak
        # (torch.cuda.max_memory_allocated) would mix them: the tensors are counted instead
        peak = self.peak
        return dict(
            mem_sharded_params_mib=self.params_bytes / MIB,
            mem_unsharded_params_mib=self.unsharded / MIB,
            mem_grads_mib=self.grads / MIB,
            mem_optimizer_mib=self.optim / MIB,
            mem_activations_mib=self.acts / MIB,
            mem_peak_mib=peak / MIB,
        )
