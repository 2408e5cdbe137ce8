"""The timing loop: round-robin rounds with ``torch.utils.benchmark``'s synchronizing clock."""

from __future__ import annotations

import timeit
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from torch.utils import benchmark

try:
    import resource
except ImportError:  # not on Windows
    resource = None

if TYPE_CHECKING:
    from mpnb.lab.bench._harness import Candidate, Options

__all__ = ["time_rounds"]


def _calls_per_round(fn: Callable[[], object], warmup: int, round_time: float) -> int:
    """The calls of ``fn`` that fill a round of ``round_time`` seconds, from its steady-state
    time: its ``warmup`` calls run first, each timed (with one, a second call too), and only a
    call slower than a round even at its fastest ends there (a first call may build a cache or
    compile a kernel: averaged in, it made rounds of a cached launcher 30 calls long where
    1,500 fill the time, and a GPU kernel's first compile made its rounds one call long); then
    calls doubling in number until they run a tenth of a round."""
    timer = timeit.Timer(fn, timer=benchmark.timer)
    warmup = max(warmup, 1)
    spent = min(timer.timeit(1) for _ in range(warmup))
    if spent >= round_time and warmup == 1:
        spent = timer.timeit(1)  # the one warm-up call may have compiled: a warm call decides
    if spent >= round_time:
        return 1  # even its fastest warm call fills a round
    n = 1
    while spent < round_time / 10 and n < _MAX_CALLS:
        n = min(2 * n, _MAX_CALLS)
        spent = timer.timeit(n)
    return max(1, min(_MAX_CALLS, round(round_time * n / max(spent, 1e-9))))


_MAX_CALLS = 100_000  #: calls per round at most


def _preemptions() -> int:
    # Involuntary context switches of all this process's threads: how often the OS took a
    # core away mid-measurement (a parallel region then waits for the preempted thread).
    if resource is None:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


def time_rounds(
    cands: Sequence[Candidate],
    opts: Options,
    numbers: Sequence[int] | None = None,
    first: int = 0,
) -> tuple[list[list[float]], list[int], list[float]]:
    """Time ``cands`` round-robin: per-call times per round, calls per round, preemptions per call.

    Each callable first runs ``opts.warmup`` times (which also sets its call count so that a
    round takes about ``opts.round_time``); then each round runs every callable once, in an
    order rotated by one each round.

    Args:
        cands: the callables to time.
        opts: ``rounds``, ``warmup`` and ``round_time``.
        numbers: the calls per round of each callable, from an earlier call of this function
            on the same callables: no warm-up then, and more rounds of the same length (the
            harness adds rounds to a case this way until its interval is narrow enough).
        first: the index of the first round (the rotation continues where it stopped).
    """
    if numbers is None:
        numbers = [_calls_per_round(c.fn, opts.warmup, opts.round_time) for c in cands]
    numbers = list(numbers)
    timers = [timeit.Timer(c.fn, timer=benchmark.timer) for c in cands]
    times: list[list[float]] = [[] for _ in cands]
    preempted = [0] * len(cands)
    for r in range(first, first + opts.rounds):
        # Rotate who goes first each round so no candidate always follows the same one.
        for k in range(len(cands)):
            i = (k + r) % len(cands)
            before = _preemptions()
            times[i].append(timers[i].timeit(numbers[i]) / numbers[i])
            preempted[i] += _preemptions() - before
    per_call = [p / (opts.rounds * n) for p, n in zip(preempted, numbers, strict=True)]
    return times, numbers, per_call
