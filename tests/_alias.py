"""The unit tests of an alias module (``mpnb.amp`` is Apex's name of ``mpnb.core.amp``): it
exports the same objects as its target, and ``from ALIAS import NAME`` works for every name of
the target's ``__all__``. Each alias's unit file makes its two tests with :func:`alias_tests`."""

from __future__ import annotations

import importlib

import pytest


def alias_tests(alias_name: str, target_name: str):
    """The two tests of alias module ``alias_name`` over ``target_name``, for a unit file to
    bind as module-level names (pytest collects them there)."""
    alias, target = importlib.import_module(alias_name), importlib.import_module(target_name)

    def test_it_exports_every_name_of_the_target_as_the_same_object():
        assert alias.__all__ == target.__all__ and alias.__all__
        assert [n for n in target.__all__ if getattr(alias, n) is not getattr(target, n)] == []

    @pytest.mark.parametrize("name", target.__all__)
    def test_from_import_gives_the_targets_object(name):
        namespace: dict = {}
        exec(f"from {alias_name} import {name}", namespace)
        assert namespace[name] is getattr(target, name)

    return test_it_exports_every_name_of_the_target_as_the_same_object, (
        test_from_import_gives_the_targets_object
    )
