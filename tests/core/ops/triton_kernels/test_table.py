"""The launcher table and the usability check of the Triton kernels."""

from __future__ import annotations

import inspect

import pytest

from mpnb.core.ops import op_info
from mpnb.core.ops import triton as tk


def _reference(op: str):
    # Each op's pure-PyTorch reference: the launcher must take exactly its arguments, in order.
    return op_info(op).reference


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("op", list(tk.LAUNCHERS))
def test_launcher_signature_is_the_reference_one(op):
    got, want = _params(tk.launcher(op)), _params(_reference(op))
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, default), (_, ref_default) in zip(got, want, strict=True):
        if ref_default is not inspect.Parameter.empty:
            assert default == ref_default, f"{op}: default of {name}"


def test_table_covers_the_issue_ops():
    wanted = {
        "fused_adam_",
        "fused_sgd_",
        "fused_lamb_",
        "multi_tensor_scale",
        "multi_tensor_l2norm",
        "multi_tensor_check_finite",
        "layer_norm_fwd",
        "layer_norm_bwd",
        "rms_norm_fwd",
        "rms_norm_bwd",
        "scaled_masked_softmax_fwd",
        "scaled_upper_triang_masked_softmax_fwd",
        "scaled_softmax_bwd",
        "rope",
    }
    assert wanted <= set(tk.LAUNCHERS)


def test_unknown_op_names_the_known_ones():
    with pytest.raises(KeyError, match="ops with one: fused_adam_"):
        tk.launcher("fused_novograd_")


def test_probe_needs_opt_in_then_cuda():
    off = tk.probe_triton({}, lambda: True, table={"kernels": {}})  # nothing measured
    assert not off.usable and not off.opted_in and "MPNB_TRITON=1" in off.reason
    no_gpu = tk.probe_triton({"MPNB_TRITON": "1"}, lambda: False)
    assert not no_gpu.usable and no_gpu.opted_in and "no CUDA device" in no_gpu.reason
    assert no_gpu.version is None  # triton is not even imported without a GPU


def test_probe_with_everything_present():
    import triton

    status = tk.probe_triton({"MPNB_TRITON": "1"}, lambda: True)
    assert status.usable and status.reason == "" and status.version == triton.__version__


def test_status_is_read_once(monkeypatch):
    first = tk.triton_status()
    monkeypatch.setenv("MPNB_TRITON", "0" if first.opted_in else "1")
    assert tk.triton_status() is first
    assert tk.triton_usable() is first.usable
