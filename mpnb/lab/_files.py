"""Output files of the lab's commands: checked before a run, written whole or not at all.

A comparison or a benchmark can run for minutes; its report must not be lost to a path that
was never writable (checked up front, :func:`unwritable_reason`) nor to a write that fails
half-way (a full disk, a quota): :func:`write_atomic` writes a temporary file beside the
target and renames it over the target only once it is complete, so the previous file stays
intact when the write fails.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

__all__ = ["unwritable_reason", "check_writable", "write_atomic"]


def unwritable_reason(path: str | os.PathLike, example: str = "report.html") -> str:
    """Why a file cannot be written to ``path`` ("" when it can).

    Checked before a run, so that a long comparison never ends in a failed write. Refused: a
    directory (``example`` is the file name suggested instead), a parent directory that does
    not exist (create it first), a parent that is a file, and a place that is not writable.

    Example::

        >>> unwritable_reason("/tmp")
        '/tmp is a directory; give a file name such as /tmp/report.html'
    """
    if not str(path):
        return f"no path given; give a file name such as {example}"
    p = Path(path).expanduser().absolute()
    if p.is_dir():
        return f"{path} is a directory; give a file name such as {Path(path) / example}"
    if p.exists():
        if os.access(p, os.W_OK):
            return ""
        return f"{path} exists and is not writable; pass another path, or make it writable"
    parent = p.parent
    if not parent.exists():
        above = parent.parent
        while not above.exists():
            above = above.parent
        if not above.is_dir():
            return f"{above} is a file, so {path} cannot be created; pass another path"
        return f"the directory {parent} does not exist; create it first (mkdir -p {parent})"
    if not parent.is_dir():
        return f"{parent} is a file, so {path} cannot be created; pass another path"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"the directory {parent} is not writable; pass a path in a writable one"
    return ""


def check_writable(path: str | os.PathLike, what: str = "", example: str = "report.html") -> Path:
    """Refuse, before any work, an output ``path`` that cannot be written; return it.

    Every writer of the lab's results calls this first (see :func:`unwritable_reason` for what
    is refused). ``what`` names the argument in the message (e.g. ``"--out"``).

    Raises:
        ValueError: naming ``path``, why it cannot be written and what to pass instead.

    Example::

        >>> check_writable("/tmp", "--json", "rows.json")
        Traceback (most recent call last):
        ValueError: --json /tmp: /tmp is a directory; give a file name such as /tmp/rows.json
    """
    why = unwritable_reason(path, example)
    if why:
        raise ValueError(f"{what + ' ' if what else ''}{path}: {why}.")
    return Path(path)


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` in full, or leave ``path`` as it was.

    The text goes to a temporary file in the same directory (so the rename stays on one file
    system), is flushed to disk, and replaces ``path`` with one ``os.replace``. When writing
    fails (no space left, a quota), the temporary file is removed, ``path`` keeps its previous
    content and an ``OSError`` naming the file (not the temporary one) and the cause is
    raised. The directory must exist (:func:`check_writable` says so before a run).

    Example::

        >>> write_atomic("report.html", "<html>...</html>")
        PosixPath('report.html')
    """
    out = Path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
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
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        kept = "its previous content is kept" if out.exists() else "nothing was written"
        full = e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
        fix = "Free some space or choose another path" if full else "Choose another path"
        why = unwritable_reason(out) if not full else ""
        raise OSError(
            e.errno,
            f"could not write {out} ({why or e.strerror or e}); {kept}. {fix}, then run again.",
        ) from e
    return out
