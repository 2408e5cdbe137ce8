"""Fixtures of the lab's tests: a file system that fills up mid-write."""

from __future__ import annotations

import contextlib

import pytest


@pytest.fixture
def file_size_limit():
    """``with file_size_limit(n):`` makes any write past ``n`` bytes of a file fail with
    ``OSError(EFBIG)``, as a full disk or a quota fails it (RLIMIT_FSIZE, this process only;
    SIGXFSZ is ignored so that the write fails instead of ending the process)."""
    resource = pytest.importorskip("resource")
    import signal

    @contextlib.contextmanager
    def limit(nbytes: int):
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        before = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, before)

    return limit
