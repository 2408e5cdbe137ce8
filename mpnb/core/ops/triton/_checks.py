"""The one guard the Triton launchers keep for themselves.

Every argument check of an op lives once, in its ``check`` (:mod:`mpnb.core.ops._library`),
which runs in full before a launcher starts. What no op check can know is the raw-address
rule of a launch: a one-element flag or scale read by the kernel must live on the data's
device (a CPU tensor's address read on a GPU is out of bounds, where the references and
PyTorch's ops would copy it over).
"""

from __future__ import annotations

import torch

__all__ = ["check_same_device"]


def check_same_device(op: str, ref: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Raise unless every given tensor lives on ``ref``'s device."""
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise ValueError(
                f"{op}: {name} is on {t.device} but the data is on {ref.device}; move it to "
                f"{ref.device}."
            )
