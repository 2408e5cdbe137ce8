"""``python -m mpnb.lab.distributed``: the distributed comparison as a plain script.

Runs unchanged under torchrun (it reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` from the
environment torchrun sets; rank 0 prints the rows) and launches ``--ranks`` local ranks itself
otherwise::

    python -m mpnb.lab.distributed --ranks 2 --size small
    torchrun --standalone --nproc-per-node 2 -m mpnb.lab.distributed --size small
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m mpnb.lab.distributed --size medium --out rows.csv
"""

from __future__ import annotations

import argparse
import sys

from mpnb.lab.distributed._cli import add_arguments, run


def main(argv=None) -> int:
    """Parse the flags and run (see the module)."""
    p = argparse.ArgumentParser(
        prog="python -m mpnb.lab.distributed",
        description="Distributed precision policies (DDP, FSDP2) compared on N ranks.",
    )
    add_arguments(p, standalone=True)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
