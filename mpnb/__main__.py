"""``python -m mpnb ...`` is the ``mpnb`` command."""

from mpnb.cli import main

raise SystemExit(main())
