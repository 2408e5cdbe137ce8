"""``AttnMaskType``: Apex's two attention mask types, one enum wherever it is imported from, and
what each type makes ``FusedScaleMaskSoftmax`` do with the mask it is given."""

from __future__ import annotations

import pytest
import torch

from mpnb.compat import apex_alias
from mpnb.core.transformer import enums
from mpnb.core.transformer.enums import AttnMaskType
from mpnb.transformer.functional import FusedScaleMaskSoftmax


def test_the_members_are_apexs_names_and_values():
    assert [(m.name, m.value) for m in AttnMaskType] == [("padding", 1), ("causal", 2)]
    assert AttnMaskType(2) is AttnMaskType.causal
    assert AttnMaskType["padding"] is AttnMaskType.padding
    assert enums.__all__ == ["AttnMaskType"]


def test_every_import_path_gives_the_same_enum():
    import mpnb.core.transformer as core_transformer
    import mpnb.transformer as transformer
    import mpnb.transformer.enums as alias

    assert core_transformer.AttnMaskType is AttnMaskType
    assert transformer.AttnMaskType is AttnMaskType
    assert alias.AttnMaskType is AttnMaskType
    with apex_alias():
        from apex.transformer.enums import AttnMaskType as apex_type

    assert apex_type is AttnMaskType  # an Apex user's `is AttnMaskType.causal` checks hold


def _softmax(mask_type, fusion):
    return FusedScaleMaskSoftmax(False, False, mask_type, fusion, None, True, None)


@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "unfused"])
def test_causal_masks_the_future_without_a_mask_tensor(op_impl, fusion):
    x = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(0))
    probs = _softmax(AttnMaskType.causal, fusion)(x, None)
    future = torch.ones(5, 5, dtype=torch.bool).triu(1).expand_as(x)
    assert (probs[future] == 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3, 5))


@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "unfused"])
def test_padding_masks_what_the_tensor_says_and_nothing_without_one(op_impl, fusion):
    x = torch.randn(2, 3, 4, 6, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 1, 4, 6, dtype=torch.bool)
    mask[..., 4:] = True  # the last two keys are padding
    sm = _softmax(AttnMaskType.padding, fusion)
    probs = sm(x, mask)
    assert (probs[..., 4:] == 0).all()
    torch.testing.assert_close(probs[..., :4], torch.softmax(x[..., :4], -1))
    torch.testing.assert_close(sm(x, None), torch.softmax(x, -1))  # no mask: no masking


def test_only_a_causal_square_goes_to_the_fused_causal_kernel():
    sm = _softmax(AttnMaskType.causal, True)
    assert sm.is_kernel_available(None, 2, 3, 5, 5)
    assert not sm.is_kernel_available(None, 2, 3, 4, 5)
    assert _softmax(AttnMaskType.padding, True).is_kernel_available(None, 2, 3, 4, 5)
