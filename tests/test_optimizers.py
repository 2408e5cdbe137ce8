"""``mpnb.optimizers`` is Apex's name of :mod:`mpnb.core.optimizers`:
the same objects (checks: tests/_alias.py)."""

from tests._alias import alias_tests

(
    test_it_exports_every_name_of_the_target_as_the_same_object,
    test_from_import_gives_the_targets_object,
) = alias_tests("mpnb.optimizers", "mpnb.core.optimizers")
