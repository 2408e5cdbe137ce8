"""The Apex alias and the name table: every Apex module of the table resolves (or fails with its
port), the alias never modifies mpnb, and the Apex-named top-level modules follow one pattern."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import subprocess
import sys
import textwrap
import types

import pytest

import mpnb
from mpnb.compat import MODULES, ApexModuleProxy, apex_alias
from mpnb.compat.names import LACKS, top_level_modules

PRESENT = sorted(name for name, row in MODULES.items() if row.status != LACKS)
FLAGS = {row.build_flag for row in MODULES.values() if row.build_flag}  # e.g. fused_adam_cuda
MISSING = sorted(name for name, row in MODULES.items() if row.status == LACKS)


def _public(module) -> list[str]:
    return list(getattr(module, "__all__", [n for n in vars(module) if not n.startswith("_")]))


@pytest.mark.parametrize("name", PRESENT)
def test_every_present_apex_module_resolves_to_its_mpnb_module(name):
    target = importlib.import_module(MODULES[name].mpnb)
    rules = importlib.import_module(MODULES[name].rules) if MODULES[name].rules else None
    with apex_alias(FLAGS):
        proxy = importlib.import_module(name)
        assert isinstance(proxy, ApexModuleProxy) and proxy.__name__ == name
        for attr in _public(target):
            value, apex_child = getattr(target, attr), f"{name}.{attr}" in MODULES
            # an Apex submodule's name gives that module (a proxy), unless mpnb binds a class
            if isinstance(value, types.ModuleType) or (apex_child and not isinstance(value, type)):
                assert getattr(proxy, attr).__name__ == f"{name}.{attr}"
            elif rules is not None and attr in rules.__all__:  # mpnb's object, Apex's numerics
                assert getattr(proxy, attr) is getattr(rules, attr), f"{name}.{attr}"
            else:
                assert getattr(proxy, attr) is value, f"{name}.{attr}"
        if "." in name:  # reachable as an attribute of its parent too
            parent, _, child = name.rpartition(".")
            assert getattr(importlib.import_module(parent), child) is not None
    assert name not in sys.modules


@pytest.mark.parametrize("name", MISSING)
def test_lacking_apex_modules_fail_with_what_to_use_instead(name):
    row = MODULES[name]
    with apex_alias(), pytest.raises(ModuleNotFoundError, match="Use instead") as err:
        importlib.import_module(name)
    assert row.port in str(err.value)


def test_unknown_apex_module_fails_and_names_the_table():
    with apex_alias(), pytest.raises(ModuleNotFoundError, match=r"names\.MODULES"):
        import apex.does_not_exist  # noqa: F401


def test_imports_as_apex_clients_write_them():
    import mpnb.amp
    import mpnb.core.parallel.distributed as mpnb_distributed
    import mpnb.parallel

    with apex_alias():
        import amp_C
        import apex
        import apex.parallel.LARC
        from apex import amp
        from apex.amp._amp_state import _amp_state
        from apex.normalization.fused_layer_norm import (
            FusedLayerNormAffineFunction,
            FusedRMSNormAffineFunction,
            MixedFusedLayerNorm,
        )
        from apex.parallel.distributed import apply_flat_dist_call, flat_dist_call
        from apex.parallel.LARC import LARC

        assert amp.initialize is mpnb.amp.initialize and amp.scale_loss is mpnb.amp.scale_loss
        assert apex.parallel.DistributedDataParallel is mpnb.parallel.DistributedDataParallel
        # importing the LARC submodule leaves apex.parallel.LARC the class, as in Apex
        assert LARC is apex.parallel.LARC is mpnb.parallel.LARC
        assert flat_dist_call is mpnb_distributed.flat_dist_call
        # mpnb.normalization has a *function* named fused_layer_norm; Apex's name is the module
        import apex.normalization.fused_layer_norm as fln_module

        assert fln_module.__name__ == "apex.normalization.fused_layer_norm"
        assert apex.normalization.fused_layer_norm is fln_module
        assert callable(apply_flat_dist_call) and amp_C.multi_tensor_scale is not None
        assert amp._amp_state.__name__ == "apex.amp._amp_state"  # reachable as an attribute
        assert type(_amp_state).__name__ == "AmpStateView"
        assert callable(FusedLayerNormAffineFunction.apply)
        assert callable(FusedRMSNormAffineFunction.apply) and MixedFusedLayerNorm
        assert "parallel" in dir(apex) and "contrib" not in dir(apex)
        with pytest.raises(AttributeError, match="Use instead"):
            apex.contrib  # noqa: B018  (a lacking module is no attribute either)
    assert not [m for m in sys.modules if m == "apex" or m.startswith("apex.") or m == "amp_C"]
    with pytest.raises(ImportError):
        import apex  # noqa: F401


def test_the_alias_never_modifies_mpnb_modules():
    import mpnb.amp
    import mpnb.core.parallel
    import mpnb.parallel

    watched = [mpnb, mpnb.amp, mpnb.parallel, mpnb.core.parallel]
    before = [dict(vars(m)) for m in watched]
    with apex_alias(FLAGS):
        for name in PRESENT:
            importlib.import_module(name)
    for m, old in zip(watched, before, strict=True):
        new = vars(m)
        changed = {k for k in old.keys() | new.keys() if old.get(k) is not new.get(k)}
        assert not changed, f"{m.__name__}: {sorted(changed)}"


def test_install_refuses_when_a_real_apex_is_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))
    with pytest.raises(RuntimeError, match="already imported"):
        apex_alias()


def test_top_level_apex_modules_follow_one_pattern():
    """Each Apex-named top-level module is exactly: a docstring, ``from mpnb.core.<path> import *``
    and ``from mpnb.core.<path> import __all__``; the table lists all of them. mpnb's own
    top-level names beyond Apex (``mpnb.fp8``) follow the same pattern."""
    table = top_level_modules()
    beyond_apex = {"mpnb.fp8": "mpnb.core.fp8"}
    for name, core in {**table, **beyond_apex}.items():
        path = pathlib.Path(importlib.util.find_spec(name).origin)
        body = ast.parse(path.read_text()).body
        assert len(body) == 3 and isinstance(body[0], ast.Expr), path
        for stmt, imported in zip(body[1:], ("*", "__all__"), strict=True):
            assert isinstance(stmt, ast.ImportFrom) and stmt.module == core, path
            assert [a.name for a in stmt.names] == [imported], path
        module, home = importlib.import_module(name), importlib.import_module(core)
        assert module.__all__ == home.__all__
        for n in home.__all__:  # the same objects (subpackages: their Apex-named module)
            value = getattr(home, n)
            if isinstance(value, types.ModuleType):
                assert getattr(module, n).__name__ in (value.__name__, f"{name}.{n}")
            else:
                assert getattr(module, n) is value, f"{name}.{n}"
    root = pathlib.Path(mpnb.__file__).parent
    own = {"__init__", "__main__", "apex", "cli"}
    files = {f"mpnb.{p.stem}" for p in root.glob("*.py") if p.stem not in own}
    for p in (root / "transformer").rglob("*.py"):
        parts = p.relative_to(root).with_suffix("").parts
        files.add(".".join(("mpnb", *parts)).removesuffix(".__init__"))
    assert files - set(beyond_apex) == set(table), (
        "an Apex-named module is missing from mpnb.compat.names"
    )


def test_python_m_mpnb_apex_runs_unchanged_script(tmp_path):
    script = tmp_path / "apex_train.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        import torch
        from apex import amp
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = amp.initialize(model, optimizer, opt_level=sys.argv[1], verbosity=0)
        loss = model(torch.randn(3, 4)).float().sum()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        print("OK", sys.argv[1:], model.weight.dtype, __name__)
    """)
    )
    r = subprocess.run(
        [sys.executable, "-m", "mpnb.apex", str(script), "O2", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "OK ['O2', 'x'] torch.bfloat16 __main__" in r.stdout
    assert "mpnb.apex --cpu" not in r.stderr  # no rehearsal without --cpu
