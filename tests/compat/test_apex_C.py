"""mpnb.compat.apex_C: Apex's ``apex_C`` flatten/unflatten."""

from __future__ import annotations

import torch

from mpnb.compat import apex_C


def test_apex_c_flatten_unflatten_round_trip():
    ts = [torch.randn(2, 3), torch.randn(5), torch.randn(1, 1, 4)]
    flat = apex_C.flatten(ts)
    assert flat.shape == (6 + 5 + 4,)
    back = apex_C.unflatten(flat, ts)
    assert all(torch.equal(a, b) for a, b in zip(back, ts, strict=True))
