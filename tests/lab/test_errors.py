"""``mpnb.lab._errors``: a failure becomes one line of its row, naming the configuration and the
frame of the user's code; the divergence advice comes from the run's number format (its row in
:data:`mpnb.core.number_formats.FORMATS`), word for word what each precision needs."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import mpnb.lab
from mpnb.lab._errors import divergence_message


def _cfg(half):
    return SimpleNamespace(half_dtype=half, config=SimpleNamespace(divergence_note=lambda: ""))


@pytest.mark.parametrize(
    "half, dynamic, tail",
    [
        ("fp16", True, "(fp16, dynamic loss scale 1024); lower the learning rate, or bf16 "
         "(fp32's range)."),
        ("fp16", False, "(fp16, static loss scale 1024); lower the learning rate, use dynamic "
         "loss scaling, or bf16 (fp32's range)."),
        ("bf16", True, "(bf16, which has fp32's range: loss scaling would not help); lower the "
         "learning rate or clip the gradients."),
        ("fp8", True, "(FP8 matmuls, scaled per tensor or block); lower the learning rate or "
         "clip the gradients, and compare with O0 to see whether FP8 is the cause."),
        ("fp32", True, "(fp32: not a precision problem); lower the learning rate or clip the "
         "gradients."),
    ],
)  # fmt: skip
def test_the_advice_fits_the_format(half, dynamic, tail):
    msg = divergence_message(_cfg(half), float("nan"), 7, dynamic, 1024.0)
    assert msg.startswith("NaN divergence: the loss became nan at step 7")
    assert msg.endswith(tail)


class _Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x):
        if self.lin.weight.dtype == torch.bfloat16:
            raise RuntimeError("cannot take bf16")
        return self.lin(x)


def test_user_errors_become_rows_naming_configuration_and_frame():
    x = torch.randn(32, 8)
    df = mpnb.lab.compare(
        _Boom, (x, (x[:, 0] > 0).long()), steps=3, progress=False, threads=1
    ).set_index("opt_level")
    assert df.loc["O0", "status"] == "ok" and df.loc["O1", "status"] == "ok"
    for lvl in ("O2", "O3"):
        err = df.loc[lvl, "error"]
        assert err.startswith(f"{lvl} bf16 b") and "cannot take bf16" in err
        assert "test_errors.py" in err and "in forward" in err
    with pytest.raises(TypeError, match="fresh model"):
        mpnb.lab.compare(_Boom(), (x, x))
