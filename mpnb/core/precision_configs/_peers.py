"""The peers as configurations: what a user would pick instead of mpnb, run as rows beside ours.

``torch-amp`` is PyTorch's AMP recipe (``torch.autocast``, ``torch.amp.GradScaler``,
``torch.optim.AdamW(fused=True)``), ``tf32`` fp32 with TF32 matmuls (CUDA, Ampere and newer),
``torch-amp+compile`` the AMP recipe through ``torch.compile``. Each trains the same model, data
and seed through the same loop as mpnb's configurations; its
:meth:`~PrecisionConfig.train_step` builds the step (:mod:`._peer_steps`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from mpnb.core.dtype_names import parse_half_dtype
from mpnb.core.precision_configs._base import PrecisionConfig
from mpnb.core.precision_configs._optimizers import ADAMW_DECAY, optimizer_code
from mpnb.core.precision_configs._peer_steps import (
    CompiledTorchAmpStep,
    TF32Step,
    TorchAmpStep,
    tf32_enabled,  # noqa: F401 - re-exported: the context the tf32 step runs in
)
from mpnb.core.precision_configs._snippets import dtype_code, loop

__all__ = ["TorchAmpConfig", "TF32Config", "TorchAmpCompileConfig", "COMPILE_BUDGET_S"]

#: Seconds ``torch-amp+compile`` may spend compiling (the warm-up calls until one compiles
#: nothing) before the row becomes an error instead. A cold CPU compile of even a 3-layer MLP
#: took 44 s on the 2-core test machine; inductor's on-disk cache makes a second compile of the
#: same graph seconds. ``mpnb compare --compile-budget S`` changes it.
COMPILE_BUDGET_S = 300.0


def _grad_scaler_kw(loss_scale) -> dict:
    """``torch.amp.GradScaler``'s arguments for the run's rule (None: its defaults, which are
    Apex's: 2**16, x2 after 2000 clean steps, x0.5 on overflow)."""
    if loss_scale is None:
        return {}
    if not loss_scale.dynamic or loss_scale.growth_factor <= 1 or loss_scale.backoff_factor >= 1:
        raise ValueError(
            f"torch-amp: torch.amp.GradScaler cannot follow loss_scale={loss_scale!r}: it has no "
            "static scale and needs growth_factor > 1 and backoff_factor < 1; give a dynamic "
            "loss_scale of that kind, or leave loss_scale out (GradScaler's defaults)."
        )
    return dict(
        init_scale=loss_scale.init_scale,
        growth_factor=loss_scale.growth_factor,
        backoff_factor=loss_scale.backoff_factor,
        growth_interval=loss_scale.growth_interval,
    )


def _needs_scaling(dtype: torch.dtype) -> bool:
    """True for a half dtype whose range needs a loss scale (fp16; bf16 has fp32's exponent,
    and PyTorch recommends no scaling for it)."""
    return torch.finfo(dtype).max < torch.finfo(torch.float32).max / 2


def _device_type(model) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"


@dataclass(frozen=True)
class _Peer(PrecisionConfig):
    """What every peer shares: fp32 weights left as they are, no mpnb amp."""

    @property
    def uses_amp(self) -> bool:
        """False: a peer is PyTorch's own way (its step is :meth:`train_step`'s)."""
        return False

    @property
    def peer(self) -> bool:
        """True: a peer, measured beside mpnb's configurations."""
        return True

    def apply(self, model, optimizer=None, half_dtype=None):
        """``(model, optimizer)`` unchanged: a peer changes the step, not the model."""
        return model, optimizer


@dataclass(frozen=True)
class TorchAmpConfig(_Peer):
    """``torch.autocast`` + ``torch.amp.GradScaler`` + ``torch.optim.AdamW(fused=True)``.

    It runs once per half dtype asked for, as O1-O3 do. The scaler is enabled for fp16 (from
    the run's loss-scale rule: GradScaler's defaults are Apex's) and disabled for bf16, as
    PyTorch recommends (bf16 has fp32's range).
    """

    @property
    def autocast(self) -> bool:
        """True: the forward runs under ``torch.autocast``."""
        return True

    @property
    def loss_scaling(self) -> bool:
        """True: a run's loss-scale rule configures the fp16 GradScaler."""
        return True

    @property
    def verdict_reference(self) -> bool:
        """True: the verdict holds mpnb's best row against this one."""
        return True

    def runs_by_default(self, device_type: str) -> bool:
        """True: beside O0-O3 in every default comparison."""
        return True

    @staticmethod
    def _decay(name: str) -> float:
        # mpnb's "adamw" row decays as torch.optim.AdamW does; "adam", "fused_adam" and "sgd"
        # do not decay, so AdamW with 0 is Adam's rule for the same comparison.
        return ADAMW_DECAY if name == "adamw" else 0.0

    def make_optimizer(self, name: str, params, lr: float):
        """``torch.optim.AdamW(params, lr, weight_decay, fused=True)`` for any ``name``."""
        return torch.optim.AdamW(params, lr=lr, weight_decay=self._decay(name), fused=True)

    def optimizer_note(self, name: str) -> str:
        """What it trains with in place of ``name``."""
        return (
            f"{self.name} trains with torch.optim.AdamW(fused=True, weight_decay="
            f"{self._decay(name)!r}) for {name!r} (PyTorch's fused optimizer, as its AMP recipe)"
        )

    def halves(self, asked: Sequence[str]) -> tuple[str, ...]:
        """Once per half dtype ``asked`` for."""
        return tuple(asked)

    def half_dtype(self, asked=None, device="cpu") -> torch.dtype | None:
        """The half dtype asked for (None: the device's default)."""
        return parse_half_dtype(asked, device)

    def label(self, half: str) -> str:
        """``"torch-amp bf16"``."""
        return f"{self.name} {half}"

    def _parts(self, model, half_dtype, loss_scale):
        dev = _device_type(model)
        dtype = parse_half_dtype(half_dtype, dev)
        return dev, dtype, _grad_scaler_kw(loss_scale) if _needs_scaling(dtype) else None

    def train_step(self, model, optimizer, half_dtype=None, loss_scale=None) -> TorchAmpStep:
        """A :class:`TorchAmpStep` on ``model``'s device (GradScaler on for fp16 only)."""
        return TorchAmpStep(model, optimizer, *self._parts(model, half_dtype, loss_scale))

    def _setup_lines(self, device: str, scaled: bool) -> list[str]:
        return [f'scaler = torch.amp.GradScaler("{device}")'] if scaled else []

    def snippet(self, half: str, device: str = "cpu", optimizer: str = "adam", lr=1e-3) -> str:
        """The AMP recipe in ``half`` on ``device`` (the scaler lines for fp16 only)."""
        dev = torch.device(device).type
        scaled = _needs_scaling(parse_half_dtype(half, dev))
        make = (
            f"optimizer = torch.optim.AdamW(model.parameters(), lr={lr!r}, "
            f"weight_decay={self._decay(optimizer)!r}, fused=True)"
        )
        backward = ["scaler.scale(loss).backward()"] if scaled else ["loss.backward()"]
        step = ["scaler.step(optimizer)", "scaler.update()"] if scaled else ["optimizer.step()"]
        return loop(
            [make, *self._setup_lines(dev, scaled)],
            context=f'torch.autocast("{dev}", dtype={dtype_code(half)})',
            backward=backward,
            step=step,
            device=dev,
        )


@dataclass(frozen=True)
class TorchAmpCompileConfig(TorchAmpConfig):
    """:class:`TorchAmpConfig` through ``torch.compile(model)``, compiled before it is timed.

    Attributes:
        budget_s: the seconds its compile may take (:data:`COMPILE_BUDGET_S`); the lab reports
            the compile time in its own column, never in the step times.
    """

    budget_s: float = COMPILE_BUDGET_S

    @property
    def verdict_reference(self) -> bool:
        """False: the verdict's reference is eager torch.amp (this row stands beside it)."""
        return False

    def runs_by_default(self, device_type: str) -> bool:
        """False: compiling takes tens of seconds on a CPU; name it to run it."""
        return False

    def with_options(self, compile_budget_s: float | None = None) -> PrecisionConfig:
        """This configuration with another compile budget (None: unchanged)."""
        if compile_budget_s is None:
            return self
        if not compile_budget_s > 0:
            raise ValueError(
                f"compile_budget={compile_budget_s!r}: give the seconds torch.compile may take "
                f"(a positive number; default {COMPILE_BUDGET_S:g})."
            )
        return replace(self, budget_s=float(compile_budget_s))

    def train_step(self, model, optimizer, half_dtype=None, loss_scale=None) -> TorchAmpStep:
        """A :class:`CompiledTorchAmpStep` with this budget."""
        parts = self._parts(model, half_dtype, loss_scale)
        return CompiledTorchAmpStep(model, optimizer, *parts, budget_s=self.budget_s)

    def _setup_lines(self, device: str, scaled: bool) -> list[str]:
        return ["model = torch.compile(model)", *super()._setup_lines(device, scaled)]


@dataclass(frozen=True)
class TF32Config(_Peer):
    """fp32 training with TF32 matmuls and convolutions (CUDA, compute capability 8.0+)."""

    def runs_by_default(self, device_type: str) -> bool:
        """True on CUDA, where TF32 exists."""
        return device_type == "cuda"

    def halves(self, asked: Sequence[str]) -> tuple[str, ...]:
        """Once, in ``"tf32"``."""
        return ("tf32",)

    def unavailable(self, device="cpu") -> str:
        """Why ``device`` has no TF32 (``""``: it has)."""
        dev = torch.device(device)
        if dev.type != "cuda":
            return (
                f"unsupported on {dev.type}: TF32 is a mode of NVIDIA tensor cores, and CPU fp32 "
                "matmuls have no TF32 (the row would be O0 again); run on a CUDA GPU of compute "
                "capability 8.0 or newer (device='cuda')"
            )
        cap = torch.cuda.get_device_capability(dev)
        if cap < (8, 0):
            return (
                f"unsupported on this GPU (compute capability {cap[0]}.{cap[1]}): TF32 needs "
                "8.0 or newer (Ampere); its fp32 matmuls would be O0's again"
            )
        return ""

    def status(self, half: str, facts: Mapping | None = None, device="cpu") -> str:
        """``"native"`` where the run's device has TF32 (``facts["device"]``, a compare frame's
        hardware, names it), else ``"unsupported"``."""
        dev = (facts or {}).get("device", device) if isinstance(facts, Mapping) else device
        return "unsupported" if self.unavailable(str(dev)) else "native"

    def gemm_dtype(self, half: str) -> str:
        """``"tf32"``."""
        return "tf32"

    def train_step(self, model, optimizer, half_dtype=None, loss_scale=None) -> TF32Step:
        """A :class:`TF32Step`."""
        return TF32Step(model, optimizer)

    @staticmethod
    def flags() -> list[str]:
        """The lines that turn TF32 on, in the API this PyTorch has."""
        if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
            return [
                'torch.backends.cuda.matmul.fp32_precision = "tf32"',
                'torch.backends.cudnn.conv.fp32_precision = "tf32"',
            ]
        return ["torch.backends.cuda.matmul.allow_tf32 = True"]

    def snippet(self, half: str, device: str = "cpu", optimizer: str = "adam", lr=1e-3) -> str:
        """fp32 training after the TF32 flags (global: set them once, at the start)."""
        imp, make = optimizer_code(optimizer, lr)
        return loop([*self.flags(), make], [imp], device=torch.device(device).type)
