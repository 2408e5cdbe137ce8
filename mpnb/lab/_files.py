"""Output files of the lab's commands: checked before a run, written whole or not at all.

A comparison or a benchmark can run for minutes; its report must not be lost to a path that
was never writable (checked up front, :func:`unwritable_reason`) nor to a write that fails
half-way (a full disk, a quota): :func:`write_atomic` writes a temporary file beside the
target and renames it over the target only once it is complete, so the previous file stays
intact when the write fails.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["unwritable_reason", "write_atomic"]


def unwritable_reason(path: str | os.PathLike, example: str = "report.html") -> str:
    """Why a file cannot be written to ``path`` ("" when it can).

    Checked before a run, so that a long comparison never ends in a failed write. Missing
    parent directories are fine (the writers create them) when the nearest existing one is a
    writable directory. ``example`` is the file name suggested when ``path`` is a directory.

    Example::

        >>> unwritable_reason("/tmp")
        '/tmp is a directory; give a file name such as /tmp/report.html'
    """
    p = Path(path).expanduser().absolute()
    if p.is_dir():
        return f"{path} is a directory; give a file name such as {Path(path) / example}"
    if p.exists():
        return "" if os.access(p, os.W_OK) else f"{path} exists and is not writable"
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file, so {path} cannot be created"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"the directory {parent} is not writable"
    return ""


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` in full, or leave ``path`` as it was.

    The text goes to a temporary file in the same directory (so the rename stays on one file
    system), is flushed to disk, and replaces ``path`` with one ``os.replace``. When writing
    fails (no space left, a quota), the temporary file is removed, ``path`` keeps its previous
    content and an ``OSError`` naming the file and the cause is raised. Parent directories are
    created.

    Example::

        >>> write_atomic("out/report.html", "<html>...</html>")
        PosixPath('out/report.html')
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if out.exists():  # keep the permissions the file had (mkstemp's are 0600)
            os.chmod(tmp, out.stat().st_mode & 0o7777)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, out)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        kept = "its previous content is kept" if out.exists() else "nothing was written"
        raise OSError(
            e.errno,
            f"could not write {out} ({e.strerror or e}); {kept}. Free some space or "
            "choose another path, then run again.",
        ) from e
    return out
