"""The gradient buffers amp's strategies work on: in-place grads and fp32 masters.

Both keep lists built once, so a step makes one multi-tensor call per dtype group and its
Python work per parameter is reading ``.grad`` (and, for masters, setting it).
"""

from __future__ import annotations

from itertools import repeat
from operator import is_not

import torch

from mpnb.core.amp.scaler import LossScaler
from mpnb.core.ops import multi_tensor_scale

__all__ = ["Grads", "Masters"]

_HALF = (torch.float16, torch.bfloat16)


def _any_set(xs: list) -> bool:
    return any(map(is_not, xs, repeat(None)))


def _all_set(xs: list) -> bool:
    return all(map(is_not, xs, repeat(None)))


def _contiguous_grad(p: torch.Tensor) -> torch.Tensor:
    if not p.grad.is_contiguous():
        p.grad = p.grad.contiguous()
    return p.grad


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[int]]:
    out: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault(t.dtype, []).append(i)
    return list(out.values())


class Grads:
    """Params whose ``.grad`` the optimizer reads: unscaled in place, one call per dtype.

    Grads already unscaled when a new block starts (accumulation across blocks) are set aside
    so that the new backward starts from zero, and added back after its unscale.
    """

    def __init__(self) -> None:
        self.params: list[torch.nn.Parameter] = []
        self.stash: list | None = None
        self._simple = True  # one dtype, dense: the whole list is one kernel call

    def add(self, params: list) -> None:
        """Serve ``params`` too (a param group added after ``amp.initialize``)."""
        self.params += params
        self._simple = len({p.dtype for p in self.params}) <= 1 and all(
            p.is_contiguous() for p in self.params
        )

    def before_backward(self, keep_scaled: bool) -> None:
        """Set aside grads that are already unscaled, unless delayed grads accumulate."""
        if keep_scaled or not self.params:  # delayed: accumulate into the still-scaled grads
            return
        grads = [p.grad for p in self.params]
        if _any_set(grads):
            self.stash = grads
            for p in self.params:
                p.grad = None

    def unscale(self, scaler: LossScaler) -> None:
        """``grad /= scale`` in place (plus the grads set aside), flagging inf/NaN."""
        params = self.params
        if not params:
            return
        grads = [p.grad for p in params]
        stash, self.stash = self.stash, None
        if stash is None and self._simple and _all_set(grads):  # the common case
            scaler.unscale(grads, grads)
            return
        idx = [i for i, g in enumerate(grads) if g is not None]
        if stash is not None:
            for i, p in enumerate(params):  # unused by this backward: keep the earlier grad
                if grads[i] is None and stash[i] is not None:
                    p.grad = stash[i]
        live = [_contiguous_grad(params[i]) for i in idx]
        for sub in _by_dtype(live):
            g = [live[j] for j in sub]
            acc = None if stash is None else [stash[idx[j]] for j in sub]
            scaler.unscale(g, g, accumulate=acc)

    def discard(self) -> None:
        """A block raised: put back the grads from before it (None where there were none)."""
        stash, self.stash = self.stash, None
        for p, g in zip(self.params, repeat(None) if stash is None else stash, strict=False):
            p.grad = g


class Masters:
    """fp32 master params amp keeps for half model params, placed in ``param_groups``."""

    def __init__(self) -> None:
        self.model: list[torch.nn.Parameter] = []
        self.masters: list[torch.nn.Parameter] = []
        self.pairs: list[tuple[list, list, bool]] = []
        self._flag: torch.Tensor | None = None

    def adopt(self, optimizer, group: dict, i: int, p: torch.nn.Parameter) -> None:
        """Put an fp32 master of ``p`` in ``group["params"][i]`` (its state follows)."""
        # Contiguous whatever the model param's layout: amp's own buffers feed its kernels.
        m = torch.nn.Parameter(
            p.detach().to(torch.float32, memory_format=torch.contiguous_format).clone(),
            requires_grad=p.requires_grad,
        )
        group["params"][i] = m
        if p in optimizer.state:
            optimizer.state[m] = optimizer.state.pop(p)
        self.model.append(p)
        self.masters.append(m)

    @torch.no_grad()
    def follow_model(self, incoming: dict | None = None) -> None:
        """Re-read each master whose model param no longer holds its rounded value.

        The model's weights can change after the masters were made: a DDP constructor
        broadcasting rank 0's weights, a ``model.load_state_dict``, a user's copy. A master
        that still rounds to its param keeps its fp32 digits (a checkpoint's, say); any other
        takes the param's value, as Apex's masters, made from the half params at the first
        step, do. ``incoming``: exact fp32 values for some params (a checkpoint being loaded).
        """
        for p, m in zip(self.model, self.masters, strict=True):
            if incoming and p in incoming:
                m.copy_(incoming[p])
            elif not torch.equal(m.to(p.dtype), p):
                m.copy_(p)

    def rebuild(self) -> None:
        """Group the (model, master) pairs by model dtype: one kernel call per group."""
        self.pairs = []
        for sub in _by_dtype(self.model):
            params = [self.model[i] for i in sub]
            self.pairs.append(
                (params, [self.masters[i] for i in sub], all(p.is_contiguous() for p in params))
            )
        if self.masters and self._flag is None:
            self._flag = torch.zeros(1, device=self.masters[0].device)

    def before_backward(self, keep_scaled: bool) -> None:
        """Drop half grads an interrupted block left (delayed ones stay to accumulate)."""
        # Half grads left by an interrupted block are never added to the next one (Apex, too,
        # clears them here); delayed grads stay to accumulate.
        if not keep_scaled and self.model and _any_set([p.grad for p in self.model]):
            self.discard()

    def unscale(self, scaler: LossScaler) -> None:
        """``master.grad (+)= model.grad / scale`` in fp32; the model grads are consumed."""
        for params, masters, dense in self.pairs:
            grads = [p.grad for p in params]
            old = [m.grad for m in masters]
            if not (_all_set(grads) and not _any_set(old)):
                self._unscale_general(scaler, params, masters, grads, old)
                continue
            if not dense:
                grads = [_contiguous_grad(p) for p in params]
            out = [torch.empty_like(m) for m in masters]
            scaler.unscale(grads, out)
            for m, o in zip(masters, out, strict=True):
                m.grad = o
            for p in params:
                p.grad = None  # consumed: the next backward starts fresh

    def _unscale_general(self, scaler, params, masters, grads, old) -> None:
        idx = [i for i, g in enumerate(grads) if g is not None]
        if not idx:
            return
        live = [_contiguous_grad(params[i]) for i in idx]
        out = [torch.empty_like(masters[i]) for i in idx]
        scaler.unscale(live, out, accumulate=[old[i] for i in idx])
        for i, o in zip(idx, out, strict=True):
            masters[i].grad = o
            params[i].grad = None

    def discard(self) -> None:
        """Drop the half model grads (a block raised)."""
        for p in self.model:
            p.grad = None

    def release_grads(self) -> None:
        """After a step: drop the masters' grads (Apex does too). A new backward makes them
        afresh from the model's grads; whoever zeroes only the model's grads
        (``model.zero_grad()``, ``p.grad = None``) must not get last step's master grads
        added to the next ones."""
        for m in self.masters:
            m.grad = None

    def copy_to_model(self) -> None:
        """``model_param = master`` (rounded to half), one kernel call per dtype group."""
        with torch.no_grad():
            for params, masters, dense in self.pairs:
                if dense:  # fp32 * 1.0 is exact: a plain rounding copy
                    multi_tensor_scale(self._flag, masters, params, 1.0)
                else:
                    torch._foreach_copy_(params, masters)
