"""The launcher table and the usability check of the Triton kernels."""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest

from mpnb.core.ops import op_info
from mpnb.core.ops import triton as tk

PACKAGE = Path(tk.__file__).parent
ROOT = PACKAGE.parents[3]

#: modules whose launches another change of issue 50 puts by keyword (the optimizers, the
#: segment sums); empty once it has landed
_POSITIONAL_PENDING = {"_chunks", "_optim", "_rounding", "adam", "sgd", "lamb"}


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
    with pytest.raises(KeyError, match="fused_adam_"):
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


def _launches(path: Path) -> list[ast.Call]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "launch"
    ]


@pytest.mark.parametrize(
    "module", sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in _POSITIONAL_PENDING)
)
def test_kernels_are_launched_by_keyword(module):
    # launch(kernel, grid, name=value, ...): a parameter added to a kernel cannot shift the others
    for call in _launches(PACKAGE / f"{module}.py"):
        assert len(call.args) == 2 and not any(isinstance(a, ast.Starred) for a in call.args), (
            f"{module}.py:{call.lineno}: pass the kernel's arguments by keyword"
        )


def test_a_positional_launch_is_found(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("launch(k, (1,), x, y, BLOCK=4)\nlaunch(k, (1,), *args)\n")
    assert [len(c.args) for c in _launches(bad)] == [4, 3]


def test_the_kernels_package_imports_nothing_of_the_op_library():
    # The library registers each op's launcher with the package (tk.register), so the import
    # between them goes one way: no circle ops -> _library -> ops.triton -> ops.
    spec = importlib.util.spec_from_file_location(
        "import_cycles", ROOT / "scripts/import_cycles.py"
    )
    cycles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cycles)
    graph = cycles.import_graph(cycles.module_files())
    assert graph["mpnb.core.ops.triton"] & {"mpnb.core.ops", "mpnb.core.ops._library"} == set()
    assert not [c for c in cycles.cycles() if "mpnb.core.ops.triton" in c]


def test_the_launchers_are_the_op_tables():
    from mpnb.core.ops import all_ops

    assert dict(tk.LAUNCHERS) == {
        op.name: f"{op.triton}:{op.name}" for op in all_ops() if op.triton
    }
    with pytest.raises(TypeError):
        tk.LAUNCHERS["x"] = "scale:x"  # a read-only view: tk.register records a launcher


def test_host_side_grid_arithmetic_is_tritons_in_plain_integers(triton_kernels):
    # cdiv and next_pow2 give triton.cdiv's and triton.next_power_of_2's values without their
    # host-side call (about 2 us each, per launch)
    import triton

    from mpnb.core.ops.triton._common import cdiv, next_pow2

    for n in [*range(0, 70), 1023, 1024, 1025, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_pow2(n) == triton.next_power_of_2(max(n, 1)), n
        for b in (1, 2, 3, 256, 1024):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
    for name in ("_norm", "_optim", "rotary", "softmax"):  # the launchers use ours
        assert "triton.cdiv(" not in (PACKAGE / f"{name}.py").read_text(), name


def test_f32s_rounds_each_value_as_f32(triton_kernels):
    from mpnb.core.ops.triton._common import f32, f32s

    xs = (0.1, -0.0, 1, 1e-45, 3.4e38, -2.5e-8, True)
    assert str(f32s(*xs)) == str(tuple(map(f32, xs))) and f32s() == ()
