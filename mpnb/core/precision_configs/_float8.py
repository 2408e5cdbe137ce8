"""FP8 training recipes as precision configurations: ``nn.Linear`` layers swapped for
:class:`mpnb.fp8.Float8Linear` (but those its keep-list keeps), everything else float32."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from mpnb.core.number_formats import format_named
from mpnb.core.precision_configs._base import PrecisionConfig, StoredRole
from mpnb.core.precision_configs._snippets import loop

__all__ = ["Float8Config", "FP8_SCALES", "keep_sentence"]


def keep_sentence(spec: str) -> str:
    """The sentence a configuration's description ends with when it keeps layers (``""``
    for none)."""
    return f" Keep-list (linear layers left fp32): {spec}." if spec else ""


def _fp8_buffers(model, optimizer) -> list:
    if model is None:
        return []
    # mpnb.core.fp8 on first FP8 use: +35 ms warm, about 200 ms cold, to import this
    from mpnb.core.fp8 import Float8Linear

    return [
        b for m in model.modules() if isinstance(m, Float8Linear) for b in m.buffers(recurse=False)
    ]


FP8_SCALES = StoredRole(
    "fp8_scales",
    "the buffers of mpnb.fp8.Float8Linear layers (the delayed recipe's fp8_amax_history and "
    "fp8_scale); the current-scaling recipes keep none, their per-step scales are short-lived",
    _fp8_buffers,
)


@dataclass(frozen=True)
class Float8Config(PrecisionConfig):
    """FP8 ``nn.Linear`` layers (module swap, shared parameters), everything else float32;
    the layers its keep-list names stay ``nn.Linear`` in float32.

    Attributes:
        recipe: the :func:`mpnb.fp8.recipe` name.
        gemm_emulated: True for the block-scaled recipes (MXFP8, NVFP4, MXFP4): their GEMMs
            are emulated (dequantized blocks, float32 products) except where torch's
            block-scaled GEMM is taken, on sm100+ after its first-use check
            (:func:`mpnb.core.fp8.gemm.block_scaled_status`; :meth:`status` says which).
        format_name: the row of :data:`mpnb.core.number_formats.FORMATS` its runs are shown
            and judged in (``"fp8"``: every FP8 recipe, MXFP8's included, runs in the FP8
            dtypes; ``"nvfp4"`` and ``"mxfp4"`` for the four-bit recipes).
        recipe_options: the recipe's options, as ``(name, value)`` pairs (``nvfp4-no-rht``:
            ``(("rht", False),)``).
        keep: the canonical spec of the layers kept in float32
            (:class:`mpnb.core.fp8.keep.KeepList`, e.g. ``"keep-last=2"``; ``""``: none). A
            configuration name may carry one after ``:`` (``"nvfp4:keep-last=2"``, see
            :meth:`with_keep`); kept layers compute exactly as in ``O0``.
    """

    def make_recipe(self):
        """The :mod:`mpnb.fp8` recipe object this configuration trains with."""
        from mpnb.core.fp8 import recipe  # fp8 on first FP8 use: about 200 ms cold

        return recipe(self.recipe, **dict(self.recipe_options))

    recipe: str = "tensorwise"
    gemm_emulated: bool = False
    format_name: str = "fp8"
    recipe_options: tuple[tuple[str, object], ...] = ()
    keep: str = ""

    def keep_list(self):
        """The :class:`~mpnb.core.fp8.keep.KeepList` of :attr:`keep` (empty when ``""``)."""
        from mpnb.core.fp8.keep import KeepList  # fp8 on first FP8 use: about 200 ms cold

        return KeepList.parse(self.keep) if self.keep else KeepList()

    def with_keep(self, spec: str) -> Float8Config:
        """This configuration with the keep-list ``spec`` in place of its own, named
        ``"<name>:<canonical spec>"`` (``get_config("nvfp4:keep-last=2")`` builds it).

        Raises:
            ValueError: a bad spec (:meth:`KeepList.parse <mpnb.core.fp8.keep.KeepList.parse>`
                names the valid options).
        """
        # mpnb.core.fp8 on first FP8 use: +35 ms warm, about 200 ms cold, to import this
        from mpnb.core.fp8.keep import KeepList

        canonical = KeepList.parse(spec).spec()
        base = self.name.partition(":")[0]
        plain = self.description.removesuffix(keep_sentence(self.keep))
        return replace(
            self,
            name=f"{base}:{canonical}",
            description=plain + keep_sentence(canonical),
            keep=canonical,
        )

    @property
    def uses_amp(self) -> bool:
        """False: the recipe changes the linear layers only (:meth:`setup` adds amp's O0)."""
        return False

    def apply(self, model, optimizer=None, half_dtype=None):
        """:func:`mpnb.fp8.convert_to_float8_training` with this recipe and keep-list
        (optimizer untouched). When the keep-list kept layers, a
        :class:`~mpnb.core.fp8.keep.KeptLayersWarning` says which (the lab's row shows it)."""
        # mpnb.core.fp8 on first FP8 use: +35 ms warm, about 200 ms cold, to import this
        from mpnb.core.fp8 import convert_to_float8_training
        from mpnb.core.fp8.keep import KeptLayersWarning

        keep = self.keep_list()
        model = convert_to_float8_training(model, self.make_recipe(), keep=keep)
        if keep and keep.kept(model):
            warnings.warn(f"{self.name}: {keep.describe(model)}", KeptLayersWarning, stacklevel=2)
        return model, optimizer

    def halves(self, asked: Sequence[str]) -> tuple[str, ...]:
        """Once, in its format (``"fp8"``), whatever half dtype was asked for."""

        return (format_named(self.format_name).name,)

    def status(self, half: str, facts: Mapping | None = None, device="cpu") -> str:
        """``"native"`` where ``device`` runs FP8 GEMMs faster than fp32 (doctor's facts), or,
        for a block-scaled recipe (:attr:`gemm_emulated`), where its GEMMs take torch's
        block-scaled path; else ``"emulated"`` (mpnb computes what ``torch._scaled_mm``
        cannot run here with wider arithmetic). ``facts`` carrying ``"device"`` (a run's
        hardware summary) name the device, and its ``"block_scaled"`` statuses, when
        recorded, are read instead of asking this process."""
        if self.gemm_emulated:
            return self._block_scaled_status(facts, device)
        return "native" if super().status(half, facts, device) == "native" else "emulated"

    def _block_scaled_status(self, facts: Mapping | None, device) -> str:
        recorded = facts.get("block_scaled") if isinstance(facts, Mapping) else None
        if isinstance(recorded, Mapping) and self.recipe in recorded:
            return "native" if recorded[self.recipe] == "native" else "emulated"
        if isinstance(facts, Mapping) and "device" in facts:
            device = facts["device"]
        from mpnb.core.fp8.gemm import block_scaled_status  # fp8 on first use: ~200 ms cold

        dtype = self.make_recipe().dtype("input")
        return block_scaled_status(device, self.recipe, (dtype, dtype))

    @property
    def note_subject(self) -> str:
        """The recipe: recipes are emulated for different reasons (the block-scaled ones
        wherever torch's block-scaled GEMM is not taken)."""
        return self.name

    def snippet(self, half: str, device: str = "cpu", optimizer: str = "adam", lr=1e-3) -> str:
        """The linear layers converted to this recipe, then plain fp32 training."""

        imp, make = self._optimizer_code(optimizer, lr)
        keep = f', keep="{self.keep}"' if self.keep else ""
        if self.recipe_options:
            opts = ", ".join(f"{k}={v!r}" for k, v in self.recipe_options)
            rec = f'recipe("{self.recipe}", {opts})'
            imports = ["from mpnb.fp8 import convert_to_float8_training, recipe", imp]
        else:
            rec = f'"{self.recipe}"'
            imports = ["from mpnb.fp8 import convert_to_float8_training", imp]
        convert = f"model = convert_to_float8_training(model, {rec}{keep})"
        return loop([convert, make], imports, device=device)

    def gemm_dtype(self, half: str) -> str:
        """``"fp8"``, or ``"fp32"`` for a block-scaled recipe (the estimate assumes its
        emulated GEMM, at fp32's rate: no GPU rate of a native block-scaled GEMM is known)."""
        return "fp32" if self.gemm_emulated else half
