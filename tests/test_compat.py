"""The Apex alias: import apex -> mpnb, lazily, removable; python -m mpnb.apex SCRIPT."""

import subprocess
import sys
import textwrap

import pytest

from mpnb.compat import apex_alias


def test_alias_resolves_and_is_removed_on_exit():
    import mpnb.amp
    import mpnb.fp16_utils

    with apex_alias():
        import apex
        import apex.amp_C
        import apex.multi_tensor_apply
        from apex import amp
        from apex.fp16_utils import FP16_Optimizer

        assert amp is mpnb.amp and FP16_Optimizer is mpnb.fp16_utils.FP16_Optimizer
        assert apex.amp_C.__name__ == "mpnb.amp_C"
        assert apex.multi_tensor_apply.__name__ == "mpnb.multi_tensor_apply"
    assert "apex" not in sys.modules and "apex.amp" not in sys.modules
    assert mpnb.amp.__spec__.name == "mpnb.amp"  # the real spec is left intact
    with pytest.raises(ImportError):
        import apex  # noqa: F401


@pytest.mark.parametrize(
    "name, real",
    [
        ("apex.optimizers", "mpnb.optimizers"),
        ("apex.normalization", "mpnb.normalization"),
        ("apex.parallel", "mpnb.parallel"),
        ("apex.does_not_exist", "mpnb.does_not_exist"),
    ],
)
def test_missing_modules_name_the_mpnb_module(name, real):
    import importlib
    import importlib.util

    with apex_alias():
        if importlib.util.find_spec(real) is not None:
            assert importlib.import_module(name).__name__ == real
        else:
            with pytest.raises(ImportError, match=real.replace(".", r"\.")):
                importlib.import_module(name)


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
    r = subprocess.run(
        [sys.executable, "-m", "mpnb.apex"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "usage" in r.stderr
