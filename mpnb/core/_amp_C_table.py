"""Apex's ``amp_C`` as one table: a row per ``multi_tensor_*`` function, and the shims derived
from it.

Each :class:`Row` holds what Apex's ``csrc/amp_C_frontend.cpp`` fixes about the function (its
positional parameters after ``chunk_size, noop_flag, tensor_lists``, and the layout of
``tensor_lists``) and the mpnb op it maps onto. That row is the one place a signature is
spelled: :func:`apex_shim` turns a body that reads its call by name (``a.lr``, ``a.g``) into
the function with Apex's positional signature, for the shims of :mod:`mpnb.core.amp_C` and for
the references of :mod:`mpnb.core.amp_C_reference` alike::

    @apex_shim
    def multi_tensor_scale(a):
        \"\"\"``[src, dst]``: ``dst = src * scale``.\"\"\"
        call_op(ops.multi_tensor_scale, a)

The generated function checks the number of tensor lists (naming the layout) and hands the
body one named tuple: ``noop_flag``, each list by its name (an optional list absent: ``None``)
and each parameter. ``chunk_size`` is accepted and not read: the kernels pick their chunks.
:func:`call_op` calls the row's op by keyword, each argument read from the call by name (the
lists are named as the ops name them), so a body spells only what differs from Apex's call.
"""

from __future__ import annotations

import functools
import inspect
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["ROWS", "Row", "apex_shim", "call_op", "value"]


@dataclass(frozen=True)
class Row:
    """One Apex ``amp_C`` function: ``params`` are Apex's positional names after
    ``chunk_size, noop_flag, tensor_lists`` (``name=default`` where Apex has an optional),
    ``lists`` the names of its tensor lists in order (``[name]``: a list that may be absent),
    ``op`` the mpnb op it maps onto (``None``: computed with torch's ``_foreach`` ops)."""

    name: str
    params: str
    lists: str
    op: str | None

    @property
    def list_names(self) -> list[str]:
        """The tensor lists' names, in Apex's order."""
        return [n.strip("[]") for n in self.lists.split()]

    @property
    def list_counts(self) -> range:
        """How many tensor lists Apex accepts."""
        return range(sum("[" not in n for n in self.lists.split()), len(self.list_names) + 1)

    @property
    def param_names(self) -> list[str]:
        """Apex's positional parameter names after ``tensor_lists``."""
        return [p.split("=")[0].strip() for p in self.params.split(",") if p.strip()]


#: One row a function: ``name: tensor lists -> mpnb op`` (``[x]``: a list that may be absent;
#: ``-``: torch's ``_foreach`` ops), then Apex's parameters after ``tensor_lists``, indented.
#: ``update_scale_hysteresis``, Apex's one function without tensor lists, is
#: :func:`mpnb.core.ops.update_scale_hysteresis` itself, with Apex's names.
_TABLE = """
multi_tensor_scale: src dst -> multi_tensor_scale
    scale
multi_tensor_axpby: x y out -> multi_tensor_axpby
    a b arg_to_check
multi_tensor_l2norm: tensors -> multi_tensor_l2norm
    per_tensor=False
multi_tensor_l2norm_mp: tensors -> multi_tensor_l2norm
    per_tensor=False
multi_tensor_l2norm_scale: src dst -> multi_tensor_l2norm
    scale per_tensor=False
multi_tensor_unscale_l2norm: tensors -> multi_tensor_l2norm
    inv_scale per_tensor=False
multi_tensor_check_finite: tensors -> multi_tensor_check_finite
multi_tensor_lamb_stage1_cuda: g p m v upd -> -
    per_tensor_decay step beta1 beta2 epsilon global_grad_norm max_global_grad_norm
multi_tensor_lamb_stage2_cuda: p upd -> -
    per_tensor_param_norm per_tensor_update_norm lr weight_decay use_nvlamb=False
multi_tensor_adam: grads params exp_avgs exp_avg_sqs -> fused_adam_
    lr beta1 beta2 epsilon step mode bias_correction weight_decay
multi_tensor_adam_capturable: grads params exp_avgs exp_avg_sqs -> fused_adam_
    lr beta1 beta2 epsilon step mode bias_correction weight_decay inv_scale
multi_tensor_adam_capturable_master: grads params exp_avgs exp_avg_sqs masters -> fused_adam_
    lr beta1 beta2 epsilon step mode bias_correction weight_decay inv_scale
multi_tensor_sgd: grads w momentum_buffers [model] -> fused_sgd_
    wd momentum dampening lr nesterov first_run wd_after_momentum scale
multi_tensor_lamb: grads params exp_avgs exp_avg_sqs -> fused_lamb_
    lr beta1 beta2 epsilon step bias_correction weight_decay grad_averaging mode
    global_grad_norm max_grad_norm use_nvlamb=False
multi_tensor_lamb_mp: grads w exp_avgs exp_avg_sqs [model] -> fused_lamb_
    lr beta1 beta2 epsilon step bias_correction weight_decay grad_averaging mode
    global_grad_norm max_grad_norm use_nvlamb found_inf inv_scale
multi_tensor_novograd: grads params exp_avgs -> fused_novograd_
    grad_norms lr beta1 beta2 epsilon step bias_correction weight_decay grad_averaging mode
    norm_type
multi_tensor_adagrad: grads params sums -> fused_adagrad_
    lr epsilon mode weight_decay
"""


def _rows(table: str) -> dict[str, Row]:
    rows: list[list] = []
    for line in table.strip().splitlines():
        if line.startswith(" "):
            rows[-1][1].extend(line.split())
        else:
            name, lists, op = (x.strip() for x in line.replace("->", ":").split(":"))
            rows.append([name, [], lists, None if op == "-" else op])
    return {n: Row(n, ", ".join(ps), lists, op) for n, ps, lists, op in rows}


#: the table, by Apex's name
ROWS: dict[str, Row] = _rows(_TABLE)


def _split(row: Row) -> Callable:
    counts, n = row.list_counts, len(row.list_names)

    def split(tensor_lists) -> list:
        if len(tensor_lists) not in counts:
            raise ValueError(
                f"amp_C.{row.name}: expected the tensor lists [{', '.join(row.list_names)}] "
                f"({' or '.join(map(str, counts))} lists), got {len(tensor_lists)}; pass them "
                "in that order."
            )
        return [list(t) for t in tensor_lists] + [None] * (n - len(tensor_lists))

    return split


def apex_shim(body: Callable, name: str | None = None) -> Callable:
    """The function with Apex's signature of the row ``name`` (default: the body's name,
    ``reference_`` removed) that calls ``body(a)``, ``a`` the call as one named tuple; the
    body's docstring is the function's."""
    fn_name = name or body.__name__
    row = ROWS[fn_name.removeprefix("reference_")]
    Args = namedtuple(f"{row.name}_args", ["noop_flag", *row.list_names, *row.param_names])
    names = ", ".join(row.param_names)
    src = (
        f"def {fn_name}(chunk_size, noop_flag, tensor_lists, {row.params}):\n"
        f"    return _body(_Args(noop_flag, *_split(tensor_lists), {names}))\n"
    )
    scope = {"_body": body, "_Args": Args, "_split": _split(row)}
    exec(compile(src, f"<amp_C {fn_name}>", "exec"), scope)  # noqa: S102 - the row's signature
    fn = scope[fn_name]
    fn.__doc__, fn.__module__, fn.row = body.__doc__, body.__module__, row
    return fn


#: the ops' argument names that Apex spells otherwise
_APEX_NAME = {"eps": "epsilon", "found_inf": "noop_flag"}


def value(x) -> float:
    """A number Apex passes as a number or a one-element tensor, read on the host."""
    return float(x.reshape(-1)[0].item()) if isinstance(x, torch.Tensor) else float(x)


_AS_TYPE = {"float": value, "int": lambda x: int(value(x)), "bool": bool}


@functools.cache
def _op_params(op: Callable) -> tuple[tuple[str, str], ...]:
    return tuple((n, str(p.annotation)) for n, p in inspect.signature(op).parameters.items())


def call_op(op: Callable, a, **given):
    """``op`` called by keyword: each of its arguments from ``given``, else Apex's argument of
    that name in the call ``a`` (``epsilon`` for ``eps``, ``noop_flag`` for ``found_inf``) as
    the op's annotated type (a number Apex passes as a one-element tensor is read on the host),
    else the op's default."""
    for name, hint in _op_params(op):
        apex = _APEX_NAME.get(name, name)
        if name not in given and apex in a._fields:
            x = getattr(a, apex)
            given[name] = _AS_TYPE[hint](x) if hint in _AS_TYPE else x
    return op(**given)
