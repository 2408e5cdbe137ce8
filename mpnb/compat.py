"""Run unchanged Apex code: make ``import apex`` (and ``apex.*``) resolve to ``mpnb``.

:func:`apex_alias` puts an import finder on ``sys.meta_path`` that maps ``apex`` to ``mpnb``
and ``apex.X.Y`` to ``mpnb.X.Y``, lazily: nothing is imported until the script imports it, and
an Apex module mpnb does not provide yet fails with an ``ImportError`` that names the
missing ``mpnb`` module. No ``apex`` package is installed or shipped.

Example::

    >>> from mpnb.compat import apex_alias
    >>> with apex_alias():
    ...     from apex import amp          # mpnb.amp
    >>> apex_alias()                       # or: install for the rest of the process
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

__all__ = ["apex_alias", "ApexAlias"]

_PREFIX = "apex"


def _target(fullname: str) -> str:
    return "mpnb" + fullname[len(_PREFIX) :]


class ApexAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The finder/loader behind :func:`apex_alias`; also a context manager that removes it."""

    def __init__(self) -> None:
        self.installed = False
        self._spec_of: dict[str, object] = {}

    # ---- finder / loader -------------------------------------------------------------------

    def find_spec(self, fullname, path=None, target=None):
        """Answer for ``apex`` and ``apex.*`` only."""
        if fullname != _PREFIX and not fullname.startswith(_PREFIX + "."):
            return None
        real = _target(fullname)
        try:
            found = importlib.util.find_spec(real)
        except ModuleNotFoundError:
            found = None
        if found is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: the Apex alias maps it to {real!r}, which this "
                f"mpnb does not provide (yet). Check `python -c 'import {real}'`, or remove this "
                "import from the script.",
                name=fullname,
            )
        is_pkg = found.submodule_search_locations is not None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=is_pkg)

    def create_module(self, spec):
        """Return the real ``mpnb`` module (imported now) instead of a new one."""
        module = importlib.import_module(_target(spec.name))
        self._spec_of[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        """Nothing to run; put back the real module's ``__spec__`` that importlib overwrote."""
        name = module.__spec__.name if module.__spec__ else None
        if name in self._spec_of:
            module.__spec__ = self._spec_of.pop(name)

    # ---- install / remove ------------------------------------------------------------------

    def install(self) -> ApexAlias:
        """Put the finder first on ``sys.meta_path`` (idempotent)."""
        existing = sys.modules.get(_PREFIX)
        if existing is not None and not getattr(existing, "__name__", "").startswith("mpnb"):
            raise RuntimeError(
                "mpnb.compat.apex_alias: a real 'apex' package is already imported; call "
                "apex_alias() before anything imports apex, or uninstall that apex."
            )
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)
        self.installed = True
        return self

    def remove(self) -> None:
        """Take the finder off ``sys.meta_path`` and forget every ``apex*`` module it made."""
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for name in [n for n in sys.modules if n == _PREFIX or n.startswith(_PREFIX + ".")]:
            if getattr(sys.modules[name], "__name__", "").startswith("mpnb"):
                del sys.modules[name]
        self.installed = False

    def __enter__(self) -> ApexAlias:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()


def apex_alias() -> ApexAlias:
    """Install the ``apex`` -> ``mpnb`` alias now; the returned object removes it on ``with`` exit.

    Returns:
        The installed :class:`ApexAlias` (call ``.remove()`` or use it as a context manager).

    Example::

        >>> with apex_alias():
        ...     import apex.amp
        ...     assert apex.amp.initialize is mpnb.amp.initialize
    """
    return ApexAlias().install()
