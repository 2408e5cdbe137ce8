"""Keep-lists: the ``nn.Linear`` layers a low-precision recipe leaves in the model's precision.

A :class:`KeepList` names layers by module name or ``fnmatch`` pattern (``"head"``,
``"blocks.*.mlp.*"``; a pattern that names a module keeps every linear layer under it), by
transformer block (the first / last N, as Megatron's ``--num-layers-at-start-in-bf16`` and
``--num-layers-at-end-in-bf16``, or the last share of the blocks), and the output head.
:func:`~mpnb.core.fp8.convert.convert_to_float8_training` (``keep=``) leaves those layers
plain ``nn.Linear``: they compute exactly as the unconverted model does, in the model's own
dtype (float32 under the lab's low-precision configurations, which keep every other op in
float32; the "BF16 layers" of a bf16 run are the same idea: the run's high precision).

The blocks are found, not configured: the ``nn.ModuleList`` or ``nn.Sequential`` whose
children all have one type and each hold an ``nn.Linear`` (the one holding the most linear
layers, the first on a tie; ``blocks=`` names another). The head is every linear layer
registered after the block list, outside it.

As a spec (the text a precision configuration name carries after ``:``), options are joined
by ``:``: ``keep=PATTERN[+PATTERN...]``, ``keep-first=N``, ``keep-last=N``, ``keep-last=P%``
(the fewest last blocks that make at least P% of them), ``keep-head``, ``blocks=FQN``, or
``keep-none``.

Example::

    >>> keep = KeepList.parse("keep-last=1:keep-head")
    >>> keep.kept(gpt)
    ['blocks.1.qkv', 'blocks.1.proj', 'blocks.1.mlp.0', 'blocks.1.mlp.2', 'head']
    >>> keep.describe(gpt)
    'kept in fp32: blocks.1, head (5 of 9 linear layers, 56%)'
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

from torch import nn

from mpnb.core.dtype_names import short_name
from mpnb.core.fp8.linear import Float8Linear

__all__ = ["KeepList", "KeptLayersWarning", "find_blocks", "linear_layers"]

#: the characters that separate a spec's options and a keep option's patterns
_SEPARATORS = (":", "+", ",")
#: the most kept items a description lists before it counts the rest
_LISTED = 6


class KeptLayersWarning(UserWarning):
    """A precision configuration left some linear layers in the model's precision (its
    keep-list); the lab's row lists them in its ``warnings``."""


def _is_linear(module: nn.Module) -> bool:
    # exactly the layers the swap converts (a subclass of nn.Linear is never swapped)
    return type(module) in (nn.Linear, Float8Linear)


def _kind(module: nn.Module) -> type:
    """A module's type, Float8Linear counted as the nn.Linear it replaced (a block list of a
    converted model is the same list)."""
    return nn.Linear if _is_linear(module) else type(module)


def linear_layers(model: nn.Module) -> list[str]:
    """The qualified names of ``model``'s ``nn.Linear`` and :class:`Float8Linear` layers, in
    module order (a shared layer once, under its first name)."""
    return [fqn for fqn, m in model.named_modules() if _is_linear(m)]


def _child(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def find_blocks(model: nn.Module, blocks: str = "") -> tuple[str, list[str]] | None:
    """``(fqn of the block list, the blocks' fqns)``, or None when the model has none.

    Args:
        model: the model (converted or not).
        blocks: the block list's qualified name; ``""``: the ``nn.ModuleList`` or
            ``nn.Sequential`` whose children all have one type and each hold a linear layer,
            the one holding the most linear layers (the first on a tie).

    Raises:
        ValueError: ``blocks`` names no ``nn.ModuleList`` / ``nn.Sequential`` of ``model``.
    """
    if blocks:
        try:
            mod = model.get_submodule(blocks)
        except AttributeError:
            mod = None
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            lists = [
                f for f, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))
            ]
            raise ValueError(
                f"blocks={blocks!r} is not an nn.ModuleList or nn.Sequential of "
                f"{type(model).__name__}; give one of: {', '.join(map(repr, lists)) or 'none'}."
            )
        return blocks, [_child(blocks, n) for n, _ in mod.named_children()]
    best: tuple[int, str, list[str]] | None = None
    for fqn, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        kids = list(mod.named_children())
        if not kids or len({_kind(c) for _, c in kids}) != 1:
            continue
        counts = [sum(map(_is_linear, c.modules())) for _, c in kids]
        if all(counts) and (best is None or sum(counts) > best[0]):
            best = (sum(counts), fqn, [_child(fqn, n) for n, _ in kids])
    return None if best is None else (best[1], best[2])


def _under(fqn: str, module: str) -> bool:
    return module == "" or fqn == module or fqn.startswith(module + ".")


def _matches(pattern: str, fqn: str) -> bool:
    """``fqn`` or one of the modules above it matches ``pattern``."""
    parts = fqn.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))


def _count(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what}={value!r}: expected a number of blocks, 0 or more (e.g. 2).")
    return value


@dataclass(frozen=True)
class KeepList:
    """The linear layers a low-precision recipe leaves in the model's precision.

    Attributes:
        names: module names or ``fnmatch`` patterns (``"head"``, ``"blocks.*.mlp.*"``); each
            keeps the linear layers it names and those under the modules it names, and must
            keep at least one.
        first, last: the first / last N transformer blocks (Megatron's
            ``--num-layers-at-start-in-bf16`` / ``--num-layers-at-end-in-bf16``); at most the
            model's block count.
        last_share: keep the fewest last blocks that make at least this share (0..1) of the
            blocks (``ceil(share * blocks)``); none on a model without a block list.
        head: keep the output head (the linear layers after the block list, outside it); none
            on a model without a block list.
        blocks: the block list's qualified name (``""``: found, see :func:`find_blocks`).

    Example::

        >>> KeepList(last=2).kept(gpt)           # the last two blocks' linear layers
        >>> KeepList.of("keep=head:keep-first=1").spec()
        'keep=head:keep-first=1'
    """

    names: tuple[str, ...] = ()
    first: int = 0
    last: int = 0
    last_share: float = 0.0
    head: bool = False
    blocks: str = ""

    def __post_init__(self) -> None:
        names = (self.names,) if isinstance(self.names, str) else tuple(self.names)
        for n in names:
            if not isinstance(n, str) or not n or any(s in n for s in _SEPARATORS):
                raise ValueError(
                    f"keep name {n!r}: expected a module name or fnmatch pattern without "
                    "':', '+' or ',' (e.g. 'head' or 'blocks.*.mlp.*'); give several as a list."
                )
        object.__setattr__(self, "names", names)
        _count(self.first, "keep-first")
        _count(self.last, "keep-last")
        share = self.last_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ValueError(
                f"last_share={share!r}: expected a share of the blocks from 0 to 1 (0.15 keeps "
                "the last 15% of them)."
            )
        if share and self.last:
            raise ValueError(
                f"keep-last={self.last} and a last share of {share:g} both count the last "
                "blocks; give one of them."
            )
        object.__setattr__(self, "last_share", float(share))
        if not isinstance(self.head, bool) or not isinstance(self.blocks, str):
            raise ValueError(
                f"head={self.head!r}, blocks={self.blocks!r}: expected head True or False and "
                "blocks the qualified name of a module list ('' to find it)."
            )

    def __bool__(self) -> bool:
        """True when the list asks to keep anything."""
        return bool(self.names or self.first or self.last or self.last_share or self.head)

    # ---- specs ---------------------------------------------------------------------------

    @classmethod
    def of(cls, value) -> KeepList:
        """A KeepList from ``value``: None (keep nothing), a KeepList, a spec string
        (:meth:`parse`), a list or tuple of module names / patterns, or a dict of fields.

        Raises:
            ValueError: a bad spec or field, naming the fix. TypeError: another type.
        """
        if value is None:
            return cls()
        if isinstance(value, KeepList):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, dict):
            return cls(**value)
        if isinstance(value, (list, tuple)):
            return cls(names=tuple(value))
        raise TypeError(
            f"keep={value!r}: expected a KeepList, a spec such as 'keep-last=2:keep=head', a "
            "list of module names or patterns, a dict of KeepList fields, or None."
        )

    @classmethod
    def parse(cls, spec: str) -> KeepList:
        """The KeepList a spec says: options joined by ``:`` (see the module docstring).

        Raises:
            ValueError: an unknown or repeated option, a bad number, options joined by ``,``;
                the message names the valid form.

        Example::

            >>> KeepList.parse("keep-first=1:keep-last=1")
            KeepList(names=(), first=1, last=1, last_share=0.0, head=False, blocks='')
        """
        form = (
            "options keep=PATTERN[+PATTERN], keep-first=N, keep-last=N, keep-last=P%, "
            "keep-head, blocks=FQN or keep-none, joined by ':' (e.g. "
            "'keep-first=1:keep-last=2:keep=head')"
        )
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"keep spec {spec!r} is empty; expected {form}.")
        if "," in spec:
            raise ValueError(
                f"keep spec {spec!r}: join the options with ':', not ',' (commas separate "
                f"configurations on the command line); expected {form}."
            )
        fields: dict = {}
        seen: set[str] = set()
        for item in spec.strip().split(":"):
            key, eq, value = item.strip().partition("=")
            if key in seen:
                raise ValueError(f"keep spec {spec!r} gives {key} twice; give it once.")
            seen.add(key)
            if key == "keep-none" and not eq:
                continue
            if key == "keep-head" and not eq:
                fields["head"] = True
            elif key == "keep" and value:
                fields["names"] = tuple(value.split("+"))
            elif key in ("keep-first", "keep-last") and value:
                fields.update(_parse_count(key, value, spec))
            elif key == "blocks" and value:
                fields["blocks"] = value
            else:
                raise ValueError(f"keep spec {spec!r}: {item!r} is not an option; expected {form}.")
        if "keep-none" in seen and len(seen) > 1:
            raise ValueError(f"keep spec {spec!r}: keep-none keeps nothing; give it alone.")
        return cls(**fields)

    def spec(self) -> str:
        """The canonical spec of this list (``"keep-none"`` when it keeps nothing);
        ``KeepList.parse(k.spec()) == k``."""
        parts = []
        if self.names:
            parts.append("keep=" + "+".join(self.names))
        if self.first:
            parts.append(f"keep-first={self.first}")
        if self.last:
            parts.append(f"keep-last={self.last}")
        if self.last_share:
            parts.append(f"keep-last={self.last_share * 100:g}%")
        if self.head:
            parts.append("keep-head")
        if self.blocks:
            parts.append(f"blocks={self.blocks}")
        return ":".join(parts) or "keep-none"

    # ---- what it keeps in a model ----------------------------------------------------------

    def kept(self, model: nn.Module) -> list[str]:
        """The qualified names of the linear layers of ``model`` this list keeps, in module
        order (on a converted model too: its :class:`Float8Linear` layers count).

        Raises:
            ValueError: a name or pattern that keeps no linear layer (the message lists the
                model's linear layers), ``first``/``last`` beyond the block count or on a
                model without a block list, ``blocks`` naming no module list.
        """
        layers = linear_layers(model)
        keep: set[str] = set()
        for pattern in self.names:
            hits = {f for f in layers if _matches(pattern, f)}
            if not hits:
                raise ValueError(
                    f"keep={pattern!r} matches no nn.Linear layer of {type(model).__name__}; "
                    f"its linear layers are {_listing(layers)}: give one of these names, a "
                    "module above them ('blocks.1') or a pattern ('blocks.*.mlp.*')."
                )
            keep |= hits
        if self.first or self.last or self.last_share or self.head:
            keep |= self._by_block(model, layers)
        return [f for f in layers if f in keep]

    def _by_block(self, model: nn.Module, layers: list[str]) -> set[str]:
        found = find_blocks(model, self.blocks)
        if found is None:
            if self.first or self.last:
                raise ValueError(
                    f"{self._counts()}: {type(model).__name__} has no list of repeated blocks "
                    "(an nn.ModuleList or nn.Sequential of modules of one type, each holding "
                    "an nn.Linear); name the layers instead (keep=PATTERN), or give the list "
                    "(blocks=FQN)."
                )
            return set()
        where, blocks = found
        n = len(blocks)
        if max(self.first, self.last) > n:
            raise ValueError(
                f"{self._counts()}: {type(model).__name__} has {n} blocks ({blocks[0]} .. "
                f"{blocks[-1]}); keep at most {n} (keep-last=100% keeps them all)."
            )
        last = self.last or math.ceil(self.last_share * n - 1e-9)
        chosen = blocks[: self.first] + (blocks[n - last :] if last else [])
        keep = {f for f in layers for b in chosen if _under(f, b)}
        if self.head and where:
            inside = [i for i, f in enumerate(layers) if _under(f, where)]
            keep |= set(layers[inside[-1] + 1 :]) if inside else set()
        return keep

    def _counts(self) -> str:
        return ":".join(
            p for p in self.spec().split(":") if p.startswith(("keep-first", "keep-last"))
        )

    def share(self, model: nn.Module) -> float:
        """The share (0..1) of ``model``'s linear layers this list keeps (0 without any)."""
        layers = linear_layers(model)
        return len(self.kept(model)) / len(layers) if layers else 0.0

    def describe(self, model: nn.Module) -> str:
        """What this list keeps in ``model``, as a lab row says it: ``"kept in fp32:
        blocks.1, head (5 of 9 linear layers, 56%)"`` (whole blocks by their name; the dtype
        is the kept layers' weights')."""
        kept, layers = self.kept(model), linear_layers(model)
        if not kept:
            return f"kept in the model's precision: none (0 of {len(layers)} linear layers)"
        dtype = short_name(model.get_submodule(kept[0]).weight.dtype)
        found = find_blocks(model, self.blocks)
        items = _collapse(kept, layers, found[1] if found else [])
        shown = ", ".join(items[:_LISTED]) + (
            f" and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
        )
        pct = 100 * len(kept) / len(layers)
        return f"kept in {dtype}: {shown} ({len(kept)} of {len(layers)} linear layers, {pct:.0f}%)"


def _parse_count(key: str, value: str, spec: str) -> dict:
    """``keep-first=N`` / ``keep-last=N`` / ``keep-last=P%`` as KeepList fields."""
    try:
        if key == "keep-last" and value.endswith("%"):
            pct = float(value[:-1])
            if not 0 < pct <= 100:
                raise ValueError
            return {"last_share": pct / 100}
        n = int(value)
        if n < 0:
            raise ValueError
    except ValueError:
        share = " or a share such as 15%" if key == "keep-last" else ""
        raise ValueError(
            f"keep spec {spec!r}: {key}={value!r} is not a number of blocks; give a count "
            f"(0 or more){share}."
        ) from None
    return {key.removeprefix("keep-"): n}


def _listing(names: list[str], limit: int = 12) -> str:
    if not names:
        return "none (the model has no nn.Linear layer)"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _collapse(kept: list[str], layers: list[str], blocks: list[str]) -> list[str]:
    """The kept layers, each whole block named once by its own name, in model order."""
    kept_set, out, done = set(kept), [], set()
    whole = set()
    for b in blocks:
        inner = {f for f in layers if _under(f, b)}
        if inner and inner <= kept_set:
            whole.add(b)
    for f in kept:
        block = next((b for b in whole if _under(f, b)), None)
        if block is None:
            out.append(f)
        elif block not in done:
            done.add(block)
            out.append(block)
    return out
