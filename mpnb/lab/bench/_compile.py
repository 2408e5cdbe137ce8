"""``torch.compile`` candidates: warming one up, timed apart from its steady state.

A compiled candidate's first calls trace, lower and build C++ (tens of seconds on a CPU, less
when inductor's on-disk cache already holds the graph); later calls run the built kernels.
:func:`warm_up` calls it until a call compiles nothing and reports the time of the calls that
did compile (recompiles included) as its compile time. Only then does the candidate join the
round-robin rounds, so that the compile time never enters the steady-state median.

A call "compiled" when dynamo, AOTAutograd or inductor's graph cache counted work during it
(:func:`compile_events`); a candidate whose first call counts none ran eagerly (dynamo skipped
it), and one that hits dynamo's recompile limit would from then on run partly eagerly: both are
reported as errors rather than timed as compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils import benchmark

__all__ = [
    "MAX_WARM_CALLS",
    "Warm",
    "compile_events",
    "failure",
    "inductor_settings",
    "reset",
    "warm_up",
]

#: Calls a compiled candidate may take to stop recompiling (dynamo's own recompile limit is 8:
#: past it, the function silently runs eagerly).
MAX_WARM_CALLS = 6
_clock = benchmark.timer  # synchronizes the accelerator, as the rounds' clock does


@dataclass(frozen=True)
class Warm:
    """A compiled candidate after :func:`warm_up`.

    Args:
        seconds: wall time of the calls that compiled (tracing, lowering, C++ build, and the
            work those calls did).
        calls: how many calls compiled (1, or more with recompiles).
        cache_hits: graphs inductor found in its on-disk cache (a warm cache compiles faster).
        cache_misses: graphs it had to build.
    """

    seconds: float
    calls: int
    cache_hits: int = 0
    cache_misses: int = 0

    @property
    def cache(self) -> str:
        """``"cached"`` when every graph came from inductor's cache, else ``""``."""
        return "cached" if self.cache_hits and not self.cache_misses else ""


def _counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    ind = counters["inductor"]
    return {
        "frames": counters["frames"]["total"],
        "aot": counters["aot_autograd"]["total"],
        "hits": ind["fxgraph_cache_hit"],
        "misses": ind["fxgraph_cache_miss"] + ind["fxgraph_cache_bypass"],
    }


def compile_events() -> dict[str, int]:
    """Dynamo's running counts of compiled frames, AOTAutograd graphs and inductor's graph
    cache hits and misses (``{"frames", "aot", "hits", "misses"}``); they only grow."""
    return _counts()


def warm_up(
    fn: Callable[[], object],
    max_calls: int = MAX_WARM_CALLS,
    budget_s: float | None = None,
    way_out: str = "run with --no-compile",
    allow_cached: bool = False,
    larger: str = "give it a larger budget",
) -> Warm:
    """Call the compiled ``fn`` until one call compiles nothing; time the calls that did.

    Args:
        fn: the compiled callable (one call: the work to time later).
        max_calls: calls allowed before it must stop recompiling.
        budget_s: seconds the compiling calls may take together (None: no limit); checked
            after each call (a compile in progress is not interrupted).
        way_out: how to skip compiling, for the errors' last words.
        allow_cached: return ``Warm(0.0, 0)`` when the first call compiles nothing (the caller
            knows the graphs were compiled earlier in this process, which dynamo reuses)
            instead of raising.
        larger: how to give the compile more time, for the over-budget error.

    Raises:
        RuntimeError: the first call compiled nothing (``fn`` ran eagerly), ``fn`` still
            recompiled after ``max_calls`` calls, or the compile overran ``budget_s``. An error
            of ``torch.compile`` itself (no C++ compiler, a failed lowering, dynamo's recompile
            limit hit) propagates as raised.
    """
    start = compile_events()
    seconds, calls = 0.0, 0
    # Past its recompile limit dynamo runs the code eagerly and says so only in a log line:
    # make that an error, so that an eager run is never timed as a compiled one.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        while calls < max_calls:
            before = compile_events()
            t0 = _clock()
            fn()
            dt = _clock() - t0
            if compile_events() == before:
                break
            seconds, calls = seconds + dt, calls + 1
            if budget_s is not None and seconds > budget_s:
                raise RuntimeError(
                    f"torch.compile took {seconds:.1f} s over {calls} call(s), more than its "
                    f"budget of {budget_s:g} s; {larger}, or {way_out}."
                )
        else:
            raise RuntimeError(
                f"still recompiling after {max_calls} calls (each call changed what dynamo "
                f"guards on); make the timed callable repeat the same work, or {way_out}."
            )
    if calls == 0 and not allow_cached:
        raise RuntimeError(
            "torch.compile compiled nothing (dynamo ran the function eagerly); see "
            f"TORCH_LOGS=graph_breaks for why, or {way_out}."
        )
    end = compile_events()
    return Warm(seconds, calls, end["hits"] - start["hits"], end["misses"] - start["misses"])


def failure(err: BaseException, way_out: str = "run with --no-compile") -> str:
    """One line for a compiled candidate that could not run: the error and the way out
    (``way_out``: how to skip compiling; the bench's flag by default)."""
    if type(err).__name__ == "FailOnRecompileLimitHit":
        return (
            "torch.compile hit dynamo's recompile limit (the code recompiles per call or per "
            "tensor, e.g. at a graph break inside a loop, so it would run mostly eagerly); see "
            f"TORCH_LOGS=recompiles,graph_breaks, or {way_out}"
        )
    first = (str(err).strip().splitlines() or [""])[0]
    if len(first) > 200:
        first = first[:197] + "..."
    return (
        f"torch.compile failed: {type(err).__name__}: {first} (inductor on CPU needs a C++ "
        f"compiler and Python's headers; {way_out} to skip compiled candidates)"
    )


def inductor_settings() -> dict[str, object]:
    """The inductor settings that change a CPU compile's speed or time, for the header."""
    from torch._inductor import config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return {
        "cpp.threads": config.cpp.threads,  # -1: torch's thread count at compile time
        "compile_threads": config.compile_threads,
        "fx_graph_cache": config.fx_graph_cache,
        "cache_dir": cache_dir(),
        "cpp.simdlen": config.cpp.simdlen,
    }


def reset() -> None:
    """Forget every compiled graph (``torch._dynamo.reset()``), so that a case compiles its
    candidates from scratch: no recompile limit shared with earlier cases, no guards of
    earlier cases checked on each call."""
    torch._dynamo.reset()
