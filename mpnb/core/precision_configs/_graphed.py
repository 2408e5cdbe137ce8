"""An opt level's whole training step captured in a CUDA graph and replayed: ``O2+graph``.

amp's step reads nothing on the host with a fused optimizer (the skip, the scale update and the
step counters stay on the device), so PyTorch's whole-network capture works on it: warm up on a
side stream, capture one step (forward, ``amp.scale_loss`` backward, optimizer step) with static
inputs, then copy each batch into those inputs and replay. A replay launches the step's hundreds
of kernels with one call, so a step that waited on the host's launches becomes one the GPU
computes. :class:`GraphedAmpConfig` is that configuration (``O0+graph`` .. ``O3+graph``), and
:class:`GraphedStep` the step; ``mpnb compare --cuda-graphs`` adds the twin of each opt level
asked for.

What a captured step fixes: the shapes (every batch the same size), the set of tensors, and the
hyper-parameters held as host numbers: Adam's rules train ``FusedAdam(capturable=True)``, whose
learning rate lives in a device tensor that an LR schedule fills (the replays follow it);
FusedSGD's lr, and every optimizer's betas and weight decay, stay fixed in the capture.
Stochastic rounding refuses capture (its bits follow a host counter), and the host learns of
skipped steps and the collapse of the loss scale when it reads the counters
(``amp.state_dict()``), not during the replays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mpnb.core.precision_configs._amp import AmpConfig
from mpnb.core.precision_configs._optimizers import FUSED_FOR, make_optimizer
from mpnb.core.precision_configs._snippets import graph_loop
from mpnb.core.precision_configs._step import TrainStep

__all__ = ["GraphedAmpConfig", "GraphedStep", "WARMUP_STEPS"]

#: steps run eagerly on a side stream before the capture (lazy optimizer state, the masters'
#: first look at the model, autocast's caches), as PyTorch's whole-network recipe does
WARMUP_STEPS = 3


def _capturable(fused: str) -> str | None:
    """The option that puts the learning rate on the device, where the optimizer has one."""
    return "capturable" if fused.startswith("fused_adam") else None


def _static_copy(x):
    """A fresh copy of a batch (tensors in tuples, lists, dicts) to capture on."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_static_copy(v) for v in x)
    if isinstance(x, dict):
        return type(x)({k: _static_copy(v) for k, v in x.items()})
    return x


def _copy_into(dst, src) -> None:
    """Copy a batch into the static one it was captured on (same structure and shapes)."""
    if isinstance(dst, torch.Tensor):
        if dst.shape != src.shape:
            raise ValueError(
                f"a captured CUDA graph step got a batch of shape {tuple(src.shape)}, captured "
                f"for {tuple(dst.shape)}; keep every batch the same size (drop_last=True) or "
                "train without CUDA graphs."
            )
        dst.copy_(src, non_blocking=True)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src, strict=True):
            _copy_into(d, s)
    elif isinstance(dst, dict):
        for k in dst:
            _copy_into(dst[k], src[k])


class GraphedStep(TrainStep):
    """``inner``'s whole step (zero_grad aside: the graph's backward writes fresh grads)
    captured in a CUDA graph after :data:`WARMUP_STEPS` eager ones, then replayed.

    Args:
        inner: the configuration's eager step (an :class:`~mpnb.core.precision_configs._step.
            AmpStep` on a fused optimizer).

    Example::

        >>> step = GraphedStep(PRECISION_CONFIGS["O2"].train_step(model, FusedAdam(...)))
        >>> loss = step.run(x, y, lambda model, x, y: loss_fn(model(x), y))
    """

    def __init__(self, inner: TrainStep):
        super().__init__(inner.model, inner.optimizer, inner.module)
        self.inner = inner
        self.graph: torch.cuda.CUDAGraph | None = None
        self._warm = 0
        self._static = None  # (x, y, loss) the graph reads and writes

    def run(self, x, y, compute_loss: Callable) -> torch.Tensor:
        """One step: eager on a side stream while warming up, then the capture, then replays
        of it on copies of ``x`` and ``y`` (``compute_loss(model, x, y)`` is the forward and
        the loss)."""
        if self.graph is not None:
            sx, sy, loss = self._static
            _copy_into(sx, x)
            _copy_into(sy, y)
            self.graph.replay()
            return loss
        if self._warm < WARMUP_STEPS:
            self._warm += 1
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self.inner.run(x, y, compute_loss)
            torch.cuda.current_stream().wait_stream(side)
            return loss
        return self._capture(x, y, compute_loss)

    def _capture(self, x, y, compute_loss: Callable) -> torch.Tensor:
        sx, sy = _static_copy(x), _static_copy(y)
        self.inner.zero_grad()  # the graph's backward allocates the grads it writes
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            with self.inner.forward_context():
                loss = compute_loss(self.inner.model, sx, sy)
            self.inner.backward(loss)
            self.inner.step()
            loss = loss.detach()
        self.graph, self._static = graph, (sx, sy, loss)
        graph.replay()  # the capture ran nothing: this is the step
        return loss

    def zero_grad(self) -> None:
        """Nothing once captured (the graph writes fresh grads); the inner step's before."""
        if self.graph is None:
            self.inner.zero_grad()

    @property
    def found_inf(self) -> torch.Tensor:
        """The inner step's overflow flag (the replays write into the one captured)."""
        return self.inner.found_inf

    @property
    def scale(self) -> torch.Tensor:
        """The inner step's loss scale tensor (updated in place by every replay)."""
        return self.inner.scale

    @property
    def skips(self) -> bool:
        """As the inner step's."""
        return self.inner.skips

    def close(self) -> None:
        """Drop the graph, then close the inner step."""
        self.graph, self._static = None, None
        self.inner.close()


@dataclass(frozen=True)
class GraphedAmpConfig(AmpConfig):
    """An opt level (``level``) trained by replaying its captured step: ``O2+graph``.

    Attributes:
        level: the opt level captured (``"O0"`` .. ``"O3"``).
    """

    level: str = "O2"

    @property
    def opt_level(self) -> str:
        """The opt level ``amp.initialize`` runs (``level``)."""
        return self.level

    @property
    def captures(self) -> str:
        """The opt level it captures (``level``)."""
        return self.level

    def label(self, half: str) -> str:
        """``"O2 bf16 graph"``."""
        return f"{self.level} {half} graph"

    def runs_by_default(self, device_type: str) -> bool:
        """False: ``mpnb compare --cuda-graphs`` (or naming it) adds it."""
        return False

    def unavailable(self, device="cpu") -> str:
        """CUDA graphs exist on CUDA only."""
        if torch.device(device).type == "cuda":
            return ""
        return (
            f"{self.name} replays a CUDA graph, which needs a CUDA GPU (this run is on "
            f"{device}); run it with --device cuda, or use {self.level} here"
        )

    def make_optimizer(self, name: str, params, lr: float):
        """mpnb's fused optimizer of ``name``'s rule (capture needs a step that reads nothing
        on the host: ``torch.optim``'s Python loops read their step counts); Adam's rules are
        built ``capturable=True``, so the captured step reads its learning rate on the device
        and follows an LR schedule."""
        fused = FUSED_FOR.get(name, name)
        return make_optimizer(fused, params, lr, _capturable(fused))

    def optimizer_note(self, name: str) -> str:
        """What it trains with in place of ``name``."""
        fused = FUSED_FOR.get(name, name)
        if fused == name and not _capturable(fused):
            return ""
        return f"{self.name} trains with mpnb's fused optimizer for {name!r} ({fused}: capturable)"

    def train_step(self, model, optimizer, half_dtype=None, loss_scale=None) -> GraphedStep:
        """The level's amp step (:meth:`AmpConfig.train_step`) inside a :class:`GraphedStep`."""
        return GraphedStep(super().train_step(model, optimizer, half_dtype, loss_scale))

    def snippet(self, half: str, device: str = "cuda", optimizer: str = "adam", lr=1e-3) -> str:
        """The level's amp set-up, then PyTorch's whole-network capture and the replays."""

        half_kw = half if self.low_precision else None
        fused = FUSED_FOR.get(optimizer, optimizer)
        code = self._optimizer_code(fused, lr, _capturable(fused))
        return graph_loop(self.level, half_kw, code, WARMUP_STEPS)
