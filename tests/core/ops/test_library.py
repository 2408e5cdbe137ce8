"""The op table of ``mpnb/core/ops/_library.py``: every op, driven by its ``OpInfo`` entry (as
PyTorch's OpInfo tests are).

For each op x dtype x sample: the kernel (``torch.ops.mpnb.<op>``, which the dispatcher sends
to the C++ kernel on the CPU) and the reference (called directly) get identical fresh inputs;
their outputs and every tensor they mutate must agree within the op's tolerance (bitwise
unless its table entry says otherwise). The same loop runs ``torch.library.opcheck`` (schema,
fake, autograd registration, ``torch.compile``-ability) on the op.

The C++ kernels' parameters against the schemas that ``define`` infers:
``test_library_cpp_signatures.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import mpnb.core.ops as ops

CASES = [(op, dt) for op in ops.all_ops() for dt in op.dtypes if op.sample_inputs is not None]


def _ids(case):
    op, dt = case
    return f"{op.name}-{str(dt).replace('torch.', '')}"


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _tolerance(op, dtype, tensor_dtype):
    """The op's tolerance for one tensor of a ``dtype`` case: its ``(dtype, tensor_dtype)``
    entry (ops that mix dtypes, such as fp32 optimizer state beside bf16 params), else its
    ``dtype`` entry, else bitwise."""
    return op.tolerance.get((dtype, tensor_dtype), op.tolerance.get(dtype, (0.0, 0.0)))


def _assert_close(a, b, op, dtype, what):
    for i, (x, y) in enumerate(zip(_tensors(a), _tensors(b), strict=True)):
        assert x.dtype == y.dtype and x.shape == y.shape, (
            f"{what}[{i}]: {x.dtype}{x.shape} vs {y.dtype}{y.shape}"
        )
        rtol, atol = _tolerance(op, dtype, x.dtype)
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, equal_nan=True, msg=f"{what}[{i}]")


def test_every_op_has_samples_and_a_kernel_file():
    from mpnb.core.ops._build import csrc_dir

    assert ops.all_ops()
    for op in ops.all_ops():
        assert op.sample_inputs is not None, f"{op.name} has no sample_inputs in its table entry"
        if op.cpu_kernel:
            assert (csrc_dir() / "cpu" / f"{op.family}.cpp").is_file(), op.family


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_kernel_matches_reference(kernels, case, path):
    op, dtype = case
    ran = 0
    for sample in op.sample_inputs(dtype):
        args = tuple(op.args(**sample.kwargs))  # the schema's positional order
        args_k, args_r = copy.deepcopy(args), copy.deepcopy(args)
        if path == "kernel":
            out_k = op.overload(*args_k)
        else:
            with ops.use_reference([op.name]):
                out_k = op.overload(*args_k)
        out_r = op.reference(**op.args(*args_r)._asdict())
        _assert_close(out_k, out_r, op, dtype, f"{op.name} {sample.name}: output")
        _assert_close(args_k, args_r, op, dtype, f"{op.name} {sample.name}: argument")
        if path == "kernel" and ran == 0:  # opcheck is slow: the first sample of each dtype
            torch.library.opcheck(op.overload, copy.deepcopy(args))
        ran += 1
    assert ran > 0, f"{op.name} yields no sample for {dtype}"
