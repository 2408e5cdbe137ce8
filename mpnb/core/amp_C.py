"""Apex's ``amp_C`` extension module, with Apex's signatures, on mpnb's kernels.

Code that calls ``amp_C.multi_tensor_l2norm(chunk_size, noop_flag, [tensors], per_tensor)``
directly (Megatron does) runs unchanged against ``mpnb.amp_C``: Apex's 17 functions (and
``multi_tensor_check_finite``, an mpnb addition), each derived from its row of
:mod:`mpnb.core._amp_C_table`, some with a body of their own, held by the tests to
:mod:`mpnb.core.amp_C_reference`. Tensor arguments Apex reads on the device (``lr``, ``step``,
``inv_scale``...) are read once on the host: CUDA graphs capture PyTorch's own capturable
optimizers, not these.
"""

from __future__ import annotations

import torch

from mpnb.core import amp_C_reference as _ref
from mpnb.core import ops as _mt
from mpnb.core._amp_C_table import ROWS, apex_shim, call_op, op_params, value

__all__ = [*ROWS, "update_scale_hysteresis"]
_F32 = torch.float32


# A list op (scale, axpby, the norms, the check): the call as the row reads it.
def _list_op(a):
    return call_op(getattr(_mt, a.row.op), a)


# An optimizer step: ``step < 1`` with bias correction refused before anything is written (every
# param would become NaN/inf, as Apex's kernel leaves them, silently), the state of half params kept
# in their dtype (fp32 math, one rounding store, as Apex's kernels), Apex's step count (after
# this step) as the ops' per-param counts (before it); ``a.row.flags``: see the table.
def _step(a, **given) -> None:
    row, op, skip = a.row, getattr(_mt, a.row.op), {"host_skip", "capturable"} & {*a.row.flags}
    if "bias_correction" in a._fields and a.bias_correction and value(a.step) < 1:
        raise ValueError(
            f"amp_C.{row.name}: step={value(a.step):g} with bias_correction=1: the bias correction "
            "1 - beta**step is 0 at step 0 (negative below), so every param would become "
            "NaN/inf. Count steps from 1, as Apex's optimizers do (step += 1 before the call), "
            "or pass bias_correction=0. Nothing was written."
        )
    params, masters = (a.params, getattr(a, "masters", [])) if "params" in a._fields else (a.w, [])
    if getattr(a, "model", None) is not None:  # [w, ..., model]: w are the fp32 masters
        params, masters = a.model, a.w
    flags = [getattr(a, f) for f in ("noop_flag", "found_inf") if f in a._fields]
    if skip and (not params or any(value(f) != 0 for f in flags)):
        return
    # the state lists: Apex keeps half params' state in their dtype, the ops in fp32
    states = {n: getattr(a, n) for n in row.lists[2:] if n not in ("model", "masters")}
    kw = {n: [t.float() for t in x] if x and x[0].dtype != _F32 else x for n, x in states.items()}
    kw.update(params=params, masters=masters, found_inf=None if skip else a.noop_flag)
    if ("steps", "Tensors") in op_params(op):  # not SGD's
        step = value(getattr(a, "step", 1)) - 1.0  # the ops advance the count themselves
        kw["steps"] = [torch.full((), step, device=params[0].device) for _ in params]
    call_op(op, a, **kw, **given)
    for n, x in states.items():
        if kw[n] is not x:  # one rounding store, as Apex's kernels
            torch._foreach_copy_(x, kw[n])
    if "capturable" in row.flags:
        if not masters and params[0].dtype != _F32:
            for x in (*a.exp_avgs, *a.exp_avg_sqs):
                x.copy_(x.to(params[0].dtype))
        inv = torch.as_tensor(a.inv_scale, dtype=_F32).reshape(())
        torch._foreach_mul_(a.grads, inv.to(a.grads[0].device))


#: Apex's loss-scale update with hysteresis: the op itself has Apex's signature and names
update_scale_hysteresis = _mt.update_scale_hysteresis


@apex_shim
def multi_tensor_l2norm_mp(a):
    if value(a.noop_flag) != 0:
        dev = a.tensors[0].device if a.tensors else a.noop_flag.device
        n = len(a.tensors) if a.per_tensor else 0
        return torch.zeros(1, device=dev), torch.zeros(n, device=dev)
    return _list_op(a)


@apex_shim
def multi_tensor_l2norm_scale(a):
    norms = call_op(_mt.multi_tensor_l2norm, a, tensors=a.src)
    call_op(_mt.multi_tensor_scale, a)
    return norms


@apex_shim
def multi_tensor_novograd(a):
    if a.norm_type == 2:
        flag = torch.zeros(1, device=a.grad_norms.device)
        norms = _mt.multi_tensor_l2norm(noop_flag=flag, tensors=a.grads, per_tensor=True)[1]
    else:
        norms = torch.stack([x.abs().max().float() for x in a.grads])
    states = list(a.grad_norms.unbind())
    _step(a, exp_avg_sqs=states, grad_norms=norms.float().contiguous(), init_zero=True)


def _body(row):
    """The body of a row without one of its own above: a row without an op runs its reference
    (as an op's reference is its kernel where it has no other: the loop of Apex's kernel with
    its roundings); an op that takes ``params`` is an optimizer step; any other a list op."""
    if row.op is None:
        return getattr(_ref, f"reference_{row.name}").body
    return _step if ("params", "Tensors") in op_params(getattr(_mt, row.op)) else _list_op


# Every row's shim (``__all__``): its body above, else the one its row derives.
globals().update({n: apex_shim(_body(r), n) for n, r in ROWS.items() if n not in globals()})
