"""The randomized Hadamard transform: TE's 16-point matrix, golden vectors, orthogonality."""

import pytest
import torch

from mpnb.core.fp8 import hadamard

BF16 = torch.bfloat16


def test_the_te_matrix_is_the_signed_sylvester_matrix_over_four_in_bf16():
    h = hadamard.te_rht_matrix()
    assert h.dtype == BF16 and h.shape == (16, 16)
    syl = hadamard.sylvester_hadamard(16)
    for i in range(16):
        for j in range(16):
            assert syl[i, j] == (-1) ** bin(i & j).count("1")
    signs = torch.tensor(hadamard.TE_RHT_SIGNS)
    assert torch.equal(h.float(), signs.view(-1, 1) * syl / 4)
    assert torch.equal(h.float() @ h.float().T, torch.eye(16))  # orthogonal, exactly


def test_rht_of_a_basis_vector_is_its_signed_row_over_four():
    x = torch.zeros(1, 16)
    x[0, 3] = 1.0  # sign[3] = -1, Sylvester row 3 = (+, -, -, +) repeated
    want = torch.tensor([-0.25, 0.25, 0.25, -0.25] * 4)
    assert torch.equal(hadamard.hadamard_transform(x).float()[0], want)


def test_rht_of_a_known_16_vector():
    x = torch.zeros(16)
    x[0], x[5] = 2.0, 4.0  # 2 * row0 / 4 * (+1)  +  4 * row5 / 4 * (-1)
    row5 = [1, -1, 1, -1, -1, 1, -1, 1] * 2  # (-1)**popcount(5 & j)
    want = torch.tensor([0.5 - r for r in row5])
    got = hadamard.hadamard_transform(x.view(1, 16))
    assert got.dtype == BF16
    assert torch.equal(got.float()[0], want)


def test_rht_runs_blockwise_along_the_last_dim_and_is_inverted_by_its_transpose():
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    h = hadamard.te_rht_matrix(dtype=torch.float64)
    y = hadamard.hadamard_transform(x, h)
    assert y.dtype == torch.float64
    assert torch.allclose(y[:, 16:32], x[:, 16:32] @ h)
    back = hadamard.hadamard_transform(y, h.T.contiguous())
    assert torch.allclose(back, x)


def test_random_signs_are_reproducible_and_any_power_of_two_size_works():
    a = hadamard.random_signs(32, generator=3)
    assert torch.equal(a, hadamard.random_signs(32, generator=3))
    assert set(a.tolist()) <= {-1.0, 1.0}
    h = hadamard.hadamard_matrix(32, a, dtype=torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(32, dtype=torch.float64))


def test_bad_inputs_name_the_fix():
    with pytest.raises(ValueError, match="power of two"):
        hadamard.hadamard_matrix(12)
    with pytest.raises(ValueError, match="multiple of 16"):
        hadamard.hadamard_transform(torch.ones(2, 20))
    with pytest.raises(TypeError, match="floating"):
        hadamard.hadamard_transform(torch.ones(2, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="signs"):
        hadamard.hadamard_matrix(16, torch.ones(8))
