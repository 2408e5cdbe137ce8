"""Apex's opt levels, defined once: their names, what each does, and how a name is checked.

amp's properties per level (:data:`mpnb.core.amp.OPT_LEVELS`), the precision configurations
(:data:`mpnb.core.precision_configs.PRECISION_CONFIGS`), the lab, the CLI and the widgets all
take the names, the one-line descriptions and the default list from here, and refuse an
unknown name with :func:`check_names` (which says "the letter O, not zero" when it applies).

Example::

    >>> OPT_LEVEL_NAMES
    ('O0', 'O1', 'O2', 'O3')
    >>> parse_opt_level("02")
    Traceback (most recent call last):
    ValueError: amp.initialize: unknown opt_level '02' (use the letter O, not zero); ...
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Sequence

__all__ = ["OPT_LEVEL_DESCRIPTIONS", "OPT_LEVEL_NAMES", "check_names", "parse_opt_level"]

OPT_LEVEL_DESCRIPTIONS = types.MappingProxyType(
    {
        "O0": "Pure fp32 training.",
        "O1": "fp32 weights; torch.autocast runs the forward's listed ops in half.",
        "O2": "Half model (batch norms fp32), fp32 master weights in the optimizer.",
        "O3": "Pure half training.",
    }
)
"""Each opt level's one line (amp's verbose listing, the lab's glossary and rows)."""

#: the opt levels in order; also what compare, profile and the widgets run when not told
OPT_LEVEL_NAMES: tuple[str, ...] = tuple(OPT_LEVEL_DESCRIPTIONS)


def check_names(values: Iterable, choices: Sequence[str], what: str) -> None:
    """Refuse every value of ``values`` that is not one of ``choices``, in one ValueError.

    The message names the bad values and the choices; a value starting with the digit zero
    gets the hint "use the letter O, not zero" (``"02"`` for ``"O2"``).

    Args:
        values: the names given (non-strings are refused as unknown names).
        choices: the valid names, in the order the message lists them.
        what: the message's start, naming what was unknown (``"amp.initialize: unknown
            opt_level"``); the bad values follow it.

    Example::

        >>> check_names(["O0", "03"], OPT_LEVEL_NAMES, "unknown opt level")
        Traceback (most recent call last):
        ValueError: unknown opt level '03' (use the letter O, not zero); valid choices: ...
    """
    bad = [v for v in values if not isinstance(v, str) or v not in choices]
    if not bad:
        return
    hint = " (use the letter O, not zero)" if any(str(b).startswith("0") for b in bad) else ""
    raise ValueError(
        f"{what} {', '.join(map(repr, bad))}{hint}; valid choices: {', '.join(choices)}."
    )


def parse_opt_level(value) -> str:
    """``value`` if it names an opt level, else a ValueError listing the valid ones.

    Example::

        >>> parse_opt_level("O2")
        'O2'
    """
    check_names([value], OPT_LEVEL_NAMES, "amp.initialize: unknown opt_level")
    return value
