"""Run unchanged Apex code: ``import apex`` (and ``apex.*``, ``amp_C``, ``syncbn``...) on mpnb.

:func:`apex_alias` puts an import finder first on ``sys.meta_path`` that answers for exactly
the module names of :data:`mpnb.compat.names.MODULES`: each Apex module becomes an
:class:`ApexModuleProxy` named as in Apex (``apex.amp``) whose attributes are those of its
mpnb module (``mpnb.amp``), plus its Apex submodules (``apex.amp._amp_state``), imported on
first use. The proxies are the alias's own objects: mpnb's modules are never modified, and
removing the alias forgets every one of them. An Apex module that mpnb lacks fails to import
with a ``ModuleNotFoundError`` that says what to use instead. No ``apex`` package is installed
or shipped.

Example::

    >>> from mpnb.compat import apex_alias
    >>> with apex_alias():
    ...     from apex import amp          # mpnb.amp's functions, under Apex's name
    >>> apex_alias()                       # or: install for the rest of the process
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

from mpnb.compat.names import LACKS, MODULES

__all__ = ["apex_alias", "ApexAlias", "ApexModuleProxy"]

_MISSING = object()


def _claimed(fullname: str) -> bool:
    return fullname in MODULES or fullname == "apex" or fullname.startswith("apex.")


def _has_children(name: str) -> bool:
    return any(k.startswith(name + ".") for k in MODULES)


class ApexModuleProxy(types.ModuleType):
    """An Apex module under the alias: Apex's name, the attributes of its mpnb module.

    Attribute lookup: when the table lists ``<this name>.<attr>`` as an Apex module, that
    module (a proxy too), unless the mpnb module's attribute of that name is a class: Apex's
    packages rebind a submodule's name to its class (``from .LARC import LARC``), so
    ``apex.parallel.LARC`` is the class, also after ``import apex.parallel.LARC``. Otherwise
    the name from the row's ``rules`` module (mpnb's object with Apex's numerics) when it has
    one, else the mpnb module's attribute.
    """

    def __init__(
        self, name: str, target: types.ModuleType, rules: types.ModuleType | None = None
    ) -> None:
        super().__init__(name, target.__doc__)
        object.__setattr__(self, "__mpnb_module__", target)
        object.__setattr__(self, "__mpnb_rules__", rules)

    def __getattr__(self, attr: str):
        target = self.__dict__["__mpnb_module__"]
        rules = self.__dict__.get("__mpnb_rules__")
        if rules is not None and attr in rules.__all__:
            return getattr(rules, attr)
        value = getattr(target, attr, _MISSING)
        child = f"{self.__name__}.{attr}"
        row = MODULES.get(child)
        if row is not None and not isinstance(value, type):
            if row.status != LACKS:
                return importlib.import_module(child)
            raise AttributeError(
                f"module {self.__name__!r} has no attribute {attr!r}: mpnb does not provide "
                f"{child} ({row.note or 'not re-implemented'}). Use instead: {row.port}."
            )
        if value is _MISSING:
            raise AttributeError(
                f"module {self.__name__!r} (mpnb's {target.__name__}) has no attribute "
                f"{attr!r}; `python -m mpnb.apex --check SCRIPT` lists every Apex name a "
                "script uses and what mpnb provides."
            )
        return value

    def __setattr__(self, attr: str, value) -> None:
        target = self.__dict__.get("__mpnb_module__")
        if isinstance(value, types.ModuleType) and isinstance(getattr(target, attr, None), type):
            return  # the class keeps the name, as after Apex's ``from .LARC import LARC``
        super().__setattr__(attr, value)

    def __dir__(self) -> list[str]:
        target = self.__dict__["__mpnb_module__"]
        prefix = self.__name__ + "."
        kids = {k[len(prefix) :] for k, row in MODULES.items() if k.startswith(prefix) and row.mpnb}
        kids = {k for k in kids if "." not in k}
        return sorted(set(dir(target)) | set(self.__dict__) | kids)


class ApexAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The finder/loader behind :func:`apex_alias`; also a context manager that removes it.

    Args:
        build_flags: Apex build options whose extension modules it serves too (see
            :attr:`mpnb.compat.names.ApexModule.build_flag`).
    """

    def __init__(self, build_flags: frozenset[str] | set[str] = frozenset()) -> None:
        known = {row.build_flag for row in MODULES.values() if row.build_flag}
        unknown = set(build_flags) - known
        if unknown:
            raise ValueError(
                f"ApexAlias: unknown Apex build option(s) {sorted(unknown)}; the ones whose "
                f"modules mpnb can serve are {sorted(known)}."
            )
        self.build_flags = frozenset(build_flags)
        self.installed = False
        self._made: set[str] = set()

    # ---- finder / loader -------------------------------------------------------------------

    def find_spec(self, fullname, path=None, target=None):
        """Answer for the Apex module names of the table (and refuse other ``apex.*``)."""
        if not _claimed(fullname):
            return None
        row = MODULES.get(fullname)
        if row is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: it is not an Apex module that mpnb knows "
                "(mpnb.compat.names.MODULES lists them). Check the spelling, or remove this "
                "import from the script.",
                name=fullname,
            )
        if row.status == LACKS:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: mpnb does not provide this Apex module"
                f"{' (' + row.note + ')' if row.note else ''}. Use instead: {row.port}.",
                name=fullname,
            )
        if row.build_flag and row.build_flag not in self.build_flags:
            # As on a standard Apex build: code that probes for the module falls back.
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: a standard Apex build has no {fullname}, only "
                f"one made with {row.build_flag}, and the alias mirrors a standard build. To "
                f"serve it, use ApexAlias(build_flags={{{row.build_flag!r}}}) or "
                f"`python -m mpnb.apex {row.build_flag} SCRIPT`.",
                name=fullname,
            )
        return importlib.machinery.ModuleSpec(
            fullname, self, origin=f"alias of {row.mpnb}", is_package=_has_children(fullname)
        )

    def create_module(self, spec):
        """A new :class:`ApexModuleProxy` onto the (imported) mpnb module of the table."""
        row = MODULES[spec.name]
        target = importlib.import_module(row.mpnb)
        rules = importlib.import_module(row.rules) if row.rules else None
        self._made.add(spec.name)
        return ApexModuleProxy(spec.name, target, rules)

    def exec_module(self, module):
        """Nothing to run: the proxy reads its mpnb module."""

    # ---- install / remove ------------------------------------------------------------------

    def install(self) -> ApexAlias:
        """Put the finder first on ``sys.meta_path`` (idempotent)."""
        existing = sys.modules.get("apex")
        if existing is not None and not isinstance(existing, ApexModuleProxy):
            raise RuntimeError(
                "mpnb.compat.apex_alias: a real 'apex' package is already imported; call "
                "apex_alias() before anything imports apex, or uninstall that apex."
            )
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)
        self.installed = True
        return self

    def remove(self) -> None:
        """Take the finder off ``sys.meta_path`` and forget every module it made."""
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for name in self._made:
            if isinstance(sys.modules.get(name), ApexModuleProxy):
                del sys.modules[name]
        self._made.clear()
        self.installed = False

    def __enter__(self) -> ApexAlias:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()


def apex_alias(build_flags: frozenset[str] | set[str] = frozenset()) -> ApexAlias:
    """Install the Apex import alias now; the returned object removes it (``with`` exit).

    Args:
        build_flags: Apex build options whose extension modules to serve too; by default the
            alias mirrors a standard Apex build (``{"--deprecated_fused_adam"}`` adds
            ``fused_adam_cuda``).

    Returns:
        The installed :class:`ApexAlias` (call ``.remove()`` or use it as a context manager).

    Example::

        >>> with apex_alias():
        ...     import apex.amp
        ...     assert apex.amp.initialize is mpnb.amp.initialize
    """
    return ApexAlias(build_flags).install()
