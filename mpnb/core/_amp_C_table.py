"""Apex's ``amp_C`` as one table: a row per ``multi_tensor_*`` function, the shims derived from it.

A row holds what Apex's ``csrc/amp_C_frontend.cpp`` fixes about the function and the mpnb op it
maps onto; :func:`apex_shim` turns a body that reads its call by name (``a.lr``, ``a.grads``,
``a.row``) into the function with Apex's positional signature, for the shims of
:mod:`mpnb.core.amp_C` and the references of :mod:`mpnb.core.amp_C_reference` alike, and
:func:`call_op` calls the row's op by keyword from the call.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["ROWS", "Row", "apex_shim", "call_op", "op_params", "value"]

#: A row: ``name: tensor lists -> mpnb op`` (``[x]``: may be absent; ``-``: none), then how
#: Apex's call becomes the op's (more on a ``with`` line): the op's arguments that Apex names
#: otherwise, beyond ``_RENAMES`` (``op_arg=apex_arg``; ``op_arg=apex_arg==k``: whether it is
#: ``k``), and flags: ``host_skip``, a set ``noop_flag``/``found_inf`` read on the host writes
#: nothing; ``capturable``, that and, as Apex's capturable kernels, the grads left unscaled,
#: half params' moments rounded to their dtype. Then Apex's parameters after ``chunk_size,
#: noop_flag, tensor_lists`` (``chunk_size`` is not read: the kernels pick their chunks), then
#: ``>`` the documentation. ``w [model]``: the params, or fp32 masters with the model's params.
#: ``update_scale_hysteresis`` (no tensor lists) is :func:`mpnb.core.ops.update_scale_hysteresis`.
_TABLE = """
multi_tensor_scale: src dst -> multi_tensor_scale
    scale
    > ``dst = src * scale``; a non-finite ``src`` value sets ``noop_flag``.
multi_tensor_axpby: x y out -> multi_tensor_axpby
    a b arg_to_check
    > ``out = a*x + b*y``; ``arg_to_check`` -1/0/1 as in Apex.
multi_tensor_l2norm: tensors -> multi_tensor_l2norm
    per_tensor=False
    > ``(global_norm[1], per_tensor_norms[n or 0])``.
multi_tensor_l2norm_mp: tensors -> multi_tensor_l2norm
    per_tensor=False
    > A set ``noop_flag`` on entry skips the work: zero norms (Apex leaves them unset).
multi_tensor_l2norm_scale: src dst -> multi_tensor_l2norm
    scale per_tensor=False
    > The norms of ``src`` and ``dst = src * scale``; a non-finite ``src`` sets ``noop_flag``.
multi_tensor_unscale_l2norm: tensors -> multi_tensor_l2norm
    inv_scale per_tensor=False
    > The norms of ``tensors * inv_scale``, the tensors left as they are (clipping under amp).
multi_tensor_check_finite: tensors -> multi_tensor_check_finite
    > A read-only inf/NaN check (an mpnb addition to amp_C).
multi_tensor_lamb_stage1_cuda: g p m v upd -> -
    per_tensor_decay step beta1 beta2 epsilon global_grad_norm max_global_grad_norm
multi_tensor_lamb_stage2_cuda: p upd -> -
    per_tensor_param_norm per_tensor_update_norm lr weight_decay use_nvlamb=False
multi_tensor_adam: grads params exp_avgs exp_avg_sqs -> fused_adam_
    lr beta1 beta2 epsilon step mode bias_correction weight_decay
    > ``mode`` 0: Adam (L2 decay), 1: AdamW.
multi_tensor_adam_capturable: grads params exp_avgs exp_avg_sqs -> fused_adam_ capturable
    lr beta1 beta2 epsilon step mode bias_correction weight_decay inv_scale
    > ``mode`` 0: Adam (L2 decay), 1: AdamW; ``lr``, ``step``, ``inv_scale``: tensors.
multi_tensor_adam_capturable_master: grads params exp_avgs exp_avg_sqs masters -> fused_adam_
    lr beta1 beta2 epsilon step mode bias_correction weight_decay inv_scale
    with capturable
    > As ``multi_tensor_adam_capturable``; the fp32 masters updated, the params their copy.
multi_tensor_sgd: grads w momentum_buffers [model] -> fused_sgd_ weight_decay=wd inv_scale=scale
    wd momentum dampening lr nesterov first_run wd_after_momentum scale
    > The grads are multiplied by ``scale`` first.
multi_tensor_lamb: grads params exp_avgs exp_avg_sqs -> fused_lamb_
    lr beta1 beta2 epsilon step bias_correction weight_decay grad_averaging mode
    global_grad_norm max_grad_norm use_nvlamb=False
    > ``mode`` 0: L2 decay, 1: decoupled.
multi_tensor_lamb_mp: grads w exp_avgs exp_avg_sqs [model] -> fused_lamb_ host_skip
    lr beta1 beta2 epsilon step bias_correction weight_decay grad_averaging mode
    global_grad_norm max_grad_norm use_nvlamb found_inf inv_scale
    > FusedMixedPrecisionLamb's step; ``lr``, ``step``, ``found_inf``, ``inv_scale`` and the
    > norms (of the *scaled* grads) are tensors; ``mode`` 0: L2 decay, 1: decoupled. The grads
    > are left as they are (Apex's kernel writes the update into them).
multi_tensor_novograd: grads params exp_avgs -> fused_novograd_ reg_inside_moment=mode==0
    grad_norms lr beta1 beta2 epsilon step bias_correction weight_decay grad_averaging mode
    norm_type
    > ``grad_norms``: the per-tensor second moments, blended with this step's grad norms in
    > place; ``mode`` 0: the decay inside the moment.
multi_tensor_adagrad: grads params sums -> fused_adagrad_
    lr epsilon mode weight_decay
    > ``mode`` 0: L2 decay, 1: decoupled (adagrad_w_mode).
"""


@dataclass(frozen=True)
class Row:
    """One Apex ``amp_C`` function, a row of ``_TABLE``."""

    name: str
    lists: list[str]  # the tensor lists' names, in Apex's order
    optional: int  # how many of them, the last, may be absent
    params: list[str]  # Apex's positional parameters after tensor_lists (name=default)
    op: str | None  # the mpnb op it maps onto
    renames: dict[str, str]  # the op's argument -> Apex's
    flags: list[str]  # host_skip, capturable
    note: str

    @property
    def param_names(self) -> list[str]:
        """Apex's positional parameter names after ``tensor_lists``."""
        return [p.split("=")[0] for p in self.params]

    @property
    def doc(self) -> str:
        """The shim's documentation: Apex's call, the op, the row's note."""
        call = f"(chunk_size, noop_flag, [{', '.join(self.lists)}], {', '.join(self.params)})"
        op = f" on :func:`mpnb.core.ops.{self.op}`" if self.op else ""
        return f"Apex's ``amp_C.{self.name}{call}``{op}.\n\n{self.note}".strip()


def _rows(table: str) -> dict[str, Row]:
    rows: list[dict] = []
    for line in table.strip().splitlines():
        word, _, rest = line.strip().partition(" ")
        if not line.startswith(" "):
            name, lists, op = line.replace(" -> ", ":").split(":")
            op, _, rest = op.partition(" ")
            rows.append(dict(name=name, lists=lists.split(), op=op, params=[], note=""))
            rows[-1].update(renames={}, flags=[], optional=lists.count("["))
        if not line.startswith(" ") or word == "with":
            rows[-1]["renames"].update(w.split("=", 1) for w in rest.split() if "=" in w)
            rows[-1]["flags"] += [w for w in rest.split() if "=" not in w]
        elif word == ">":
            rows[-1]["note"] = f"{rows[-1]['note']} {rest}".strip()
        else:
            rows[-1]["params"] += line.split()
    for r in rows:
        r.update(lists=[n.strip("[]") for n in r["lists"]], op=None if r["op"] == "-" else r["op"])
    return {r["name"]: Row(**r) for r in rows}


#: the table, by Apex's name
ROWS: dict[str, Row] = _rows(_TABLE)


def apex_shim(body: Callable, name: str | None = None) -> Callable:
    """``fn`` with Apex's signature of the row ``name`` (default: the body's, less ``reference_``):
    checks the number of lists, calls ``fn.body(a)``, ``a`` the call as a named tuple (lists by
    name, absent: ``None``; ``a.row``); documented by the body, else by the row."""
    fn_name = name or body.__name__
    row = ROWS[fn_name.removeprefix("reference_")]
    n = len(row.lists)
    Args = namedtuple(f"{row.name}_args", ["noop_flag", *row.lists, *row.param_names])
    Args.row = row

    def split(tensor_lists) -> list:
        if not n - row.optional <= len(tensor_lists) <= n:
            raise ValueError(
                f"amp_C.{row.name}: expected the tensor lists [{', '.join(row.lists)}] "
                f"({n - row.optional}{f' or {n}' * bool(row.optional)} lists), got "
                f"{len(tensor_lists)}; pass them in that order."
            )
        return [list(t) for t in tensor_lists] + [None] * (n - len(tensor_lists))

    src = (
        f"def {fn_name}(chunk_size, noop_flag, tensor_lists, {', '.join(row.params)}):\n"
        f"    return _body(_Args(noop_flag, *_split(tensor_lists), {', '.join(row.param_names)}))"
    )
    scope = {"_body": body, "_Args": Args, "_split": split}
    exec(compile(src, f"<amp_C {fn_name}>", "exec"), scope)  # noqa: S102 - the row's signature
    fn = scope[fn_name]
    fn.__doc__, fn.__module__ = body.__doc__ or row.doc, sys._getframe(1).f_globals["__name__"]
    fn.row, fn.body = row, body
    return fn


def value(x) -> float:
    """A number Apex passes as a number or a one-element tensor, read on the host."""
    return float(x.reshape(-1)[0].item()) if isinstance(x, torch.Tensor) else float(x)


#: the op's arguments that every row's Apex names otherwise
_RENAMES = {"eps": "epsilon", "adam_w_mode": "mode==1", "adagrad_w_mode": "mode==1"}
# By the op's annotation (a tensor: one element, fp32); an optional factor Apex passes as the
# number 1: none (the same product)
_tensor = lambda x: torch.as_tensor(x, dtype=torch.float32).reshape(1)
_AS_TYPE = {"float": value, "int": lambda x: int(value(x)), "bool": bool, "Tensor": _tensor}
_AS_TYPE["Tensor | None"] = lambda x: None if not torch.is_tensor(x) and x == 1 else _tensor(x)


@functools.cache
def op_params(op: Callable) -> tuple[tuple[str, str], ...]:
    """The op's parameters: ``(name, annotation)`` pairs, in order."""
    return tuple((n, str(p.annotation)) for n, p in inspect.signature(op).parameters.items())


def call_op(op: Callable, a, **given):
    """``op`` called by keyword: each argument from ``given``, else the call ``a``'s by name or
    the row's rename (a list or ``noop_flag`` as it is; Apex's parameter as the op's annotated
    type, a tensor Apex passes for a number read on the host), else the op's default."""
    for name, hint in op_params(op):
        apex, _, k = a.row.renames.get(name, _RENAMES.get(name, name)).partition("==")
        if name in given or apex not in a._fields:
            continue
        x = getattr(a, apex)
        if apex not in a.row.param_names:  # the flag and the lists: as they are
            given[name] = x
        elif k:
            given[name] = x == int(k)
        elif hint == "Sequence[bool]":
            given[name] = [bool(x)] * len(given["params"])
        else:
            given[name] = _AS_TYPE[hint](x) if hint in _AS_TYPE else x
    return op(**given)
