"""Round-robin timing of zero-argument callables against PyTorch, in one process.

Shared machines drift by 15-100% between runs, so a benchmark here never compares two
separate timings. Every candidate of a :class:`Case` (the first one is the PyTorch baseline)
and the case's bandwidth baselines run round-robin after a warm-up: in each round each
callable runs ``number`` times back to back and its time per call is recorded. A candidate's
result is the median of its per-round times and their spread (IQR); its speed-up is the
**median of the per-round ratios** ``baseline / candidate`` (a slow round slows both sides),
never the ratio of the medians.

Bandwidth baselines run in the same rounds, on fp32 buffers of ``Case.bandwidth_numel``
elements: the in-place ``a += s*b`` (``a.add_(b, alpha=s)``: 3 x 4 bytes per element) for
kernels that write, the read-only ``x.sum()`` (4 bytes per element) for kernels that
only read, and the device copy ``a.copy_(b)`` (2 x 4 bytes per element; a GPU's usual
bandwidth reference) for kernels whose case asks for it (:data:`COPY`). A candidate that
declares the bytes it moves gets its achieved GB/s and the median of its per-round fraction
of the matching baseline's GB/s.

How many rounds: ``Options.rounds``, or, for a case with an :class:`Enough` rule (outside
``--quick``), that many and then more, a few at a time, until every candidate's 95% interval
of its ratio (the bootstrap of :func:`mpnb.lab.stats.median_ci`) is narrow enough, or the
case has run its most rounds or its time. A case that cannot run here (too large for this
GPU's free memory) is yielded with ``Case.skipped`` set: its rows say why, with no times.

The clock is ``torch.utils.benchmark.timer`` (it synchronizes the accelerator, if any, before
reading ``timeit.default_timer``), driven by ``timeit.Timer`` with a fixed call count per
round. ``torch.utils.benchmark.Timer.timeit`` is not used per round because it adds two
hidden warm-up calls to every measurement and defaults to one thread.

A candidate may also carry an :class:`InCache` roofline: the same kernel on a cache-resident
slice of its workload (sized by :func:`cache_resident`), timed in the same rounds at two slice
sizes so that the fixed cost of a call (dispatch, allocation, thread start) cancels out. Its
marginal throughput, in GB/s of the same bytes, is the kernel's speed when memory is no limit:
below :data:`COMPUTE_BOUND` of the same-run ``a += s*b`` bandwidth the kernel cannot reach that
fraction from memory either, and its row says it is compute-bound at its arithmetic.

A ``torch.compile`` candidate (:func:`compiled`) is first called until its graph is warm; the
time of those calls is its compile time (:attr:`Row.compile_s`), reported apart and never
part of a round. ``Options.compile`` False drops such candidates; a compile that fails becomes
an ``ERROR`` row with the reason, and the case's other candidates are timed as usual.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace

import torch

from mpnb.core._numbers import is_positive_finite
from mpnb.lab.bench import _compile
from mpnb.lab.bench._timing import time_rounds
from mpnb.lab.stats import iqr, median, median_ci, per_round_ratios, quantile, ratio_summary

__all__ = [
    "COMPUTE_BOUND",
    "InCache",
    "cache_resident",
    "l2_bytes",
    "llc_bytes",
    "RMW",
    "READ",
    "COPY",
    "Enough",
    "Candidate",
    "Case",
    "Options",
    "Row",
    "compiled",
    "quantile",
    "median",
    "iqr",
    "per_round_ratios",
    "ratio_summary",
    "run_case",
]

RMW = "rmw"  #: the candidate writes: compare with the in-place ``a += s*b`` bandwidth
READ = "read"  #: the candidate only reads: compare with the ``x.sum()`` bandwidth
COPY = "copy"  #: the candidate writes: compare with the device copy ``a.copy_(b)`` bandwidth
_BW_NAMES = {RMW: "bw: a += s*b (fp32)", READ: "bw: x.sum() (fp32)", COPY: "bw: copy (fp32)"}
#: In-cache throughput below this fraction of the same-run bandwidth: compute-bound.
COMPUTE_BOUND = 0.7


@dataclass(frozen=True)
class InCache:
    """A candidate's kernel on cache-resident slices of its workload: the roofline of its
    arithmetic on this CPU.

    Args:
        fn: the kernel on a slice that fits in the L2 caches of the run's threads.
        bytes: the bytes ``fn`` moves, counted as the candidate's own ``bytes`` are.
        small_fn: the kernel on a smaller slice of the same shape (a quarter, say), also
            parallel as ``fn`` is; its time is subtracted so that the per-call cost cancels.
        small_bytes: the bytes ``small_fn`` moves.
        one_thread: both slices run on one thread whatever the run's thread count (an op
            that keeps calls below a size on one thread, as the multi-tensor ops do under
            ``kSerialElems``). Their throughput is then one core's, and the row's is it times
            the run's threads: each thread owns whole chunks, so the threads' arithmetic adds
            up (the run's bandwidth baseline, on all threads, is what it is compared with).

    The in-cache throughput is the median over rounds of
    ``(bytes - small_bytes) / (t(fn) - t(small_fn))``, over the rounds where ``fn`` took longer
    than ``small_fn``; where that is not most rounds (a loaded machine), the row has none.
    """

    fn: Callable[[], object]
    bytes: int
    small_fn: Callable[[], object]
    small_bytes: int
    one_thread: bool = False


def _cache_sizes() -> dict[int, int]:
    """Data or unified cache sizes of cpu0 by level, in bytes, from Linux's sysfs ({} where
    it is not readable)."""
    import glob

    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    out = {}
    for path in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            with open(f"{path}/level") as f:
                level = int(f.read().strip())
            with open(f"{path}/type") as f:
                kind = f.read().strip()
            with open(f"{path}/size") as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        if kind in ("Unified", "Data") and size:
            out[level] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return out


def l2_bytes() -> int | None:
    """The L2 cache of one core in bytes, read from Linux's sysfs; None where it is not known.

    Example::

        >>> l2_bytes()  # doctest: +SKIP
        2097152
    """
    return _cache_sizes().get(2)


def llc_bytes() -> int | None:
    """The last-level cache (the highest level sysfs lists for cpu0, L3 on most x86 CPUs) in
    bytes; None where it is not known.

    Example::

        >>> llc_bytes()  # doctest: +SKIP
        8388608
    """
    sizes = _cache_sizes()
    return sizes[max(sizes)] if sizes else None


def cache_resident(
    unit_bytes: int, threads: int | None = None, most: int | None = None
) -> int | None:
    """How many units (rows, positions) of ``unit_bytes`` each make a slice that stays in cache:
    half of one core's L2 per thread (the other half for weights, scratch and the code's own
    data), at least 4 units per thread, at most ``most``; None where the L2 size is not known
    (:func:`l2_bytes`), so that no roofline is made from a guessed cache.

    Args:
        unit_bytes: the bytes a unit moves (reads and writes).
        threads: the run's threads (``torch.get_num_threads()`` when None).
        most: the workload's own unit count.

    Example::

        >>> cache_resident(16 * 1024, threads=1)  # 2 MiB L2: 64 rows of 16 KiB  # doctest: +SKIP
        64
    """
    threads = threads or torch.get_num_threads()
    l2 = l2_bytes()
    if l2 is None:
        return None
    units = max(4, l2 // 2 // max(unit_bytes, 1)) * threads
    return min(units, most) if most else units


@dataclass(frozen=True)
class Candidate:
    """One implementation to time: a zero-argument callable prepared by the suite.

    Args:
        name: shown in the table (``"torch._foreach_norm + norm"``, ``"mpnb l2norm"``).
        fn: the call to time. It must be repeatable: prepare inputs so that calling it many
            times does the same work (no drift to inf, no growing lists), and allocate outputs
            the same way as the other candidates of the case.
        bytes: bytes one call moves (reads + writes); 0 when not meaningful.
        access: :data:`RMW` (writes memory) or :data:`READ` (read-only): picks the bandwidth
            baseline this candidate is compared with.
        target: the speed-up over the case's baseline this candidate must reach (``1.7`` for
            "at least 1.7x faster"), or None.
        bw_target: the fraction of the same-run bandwidth baseline it must reach (``0.85``).
        max_extra_s: the time it may add to the baseline's, in seconds (the median over rounds
            of this minus the baseline), for a candidate that does the baseline's work plus its
            own (``50e-6``: "at most 50 us on top"), or None.
        extra_vs: the name of another candidate of the case: report the median over rounds of
            ``(this - baseline) / (other - baseline)``, the cost this adds to the baseline's
            work as a fraction of what the other adds (``extra_ratio``), or None.
        max_extra_ratio: the most that fraction may be (``0.5``: "adds at most half of what
            the other adds"), or None.
        compiled: ``fn`` runs code compiled by ``torch.compile`` (see :func:`compiled`): it is
            warmed up until it stops compiling, that time is reported apart, and it is left
            out when ``Options.compile`` is False.
        in_cache: the kernel on cache-resident slices (see :class:`InCache`): the row then
            also has its in-cache throughput and says whether it is compute-bound.
        flops: floating-point operations one call does (``6 * M * N * K`` for a Linear's
            training step); the row then has its achieved TFLOP/s. 0 when not meaningful.
        note: how the candidate runs here, shown beside it (``"fp8 (emulated)"``), or ``""``.
    """

    name: str
    fn: Callable[[], object]
    bytes: int = 0
    access: str = RMW
    target: float | None = None
    bw_target: float | None = None
    max_extra_s: float | None = None
    extra_vs: str | None = None
    max_extra_ratio: float | None = None
    compiled: bool = False
    in_cache: InCache | None = None
    flops: int = 0
    note: str = ""


def compiled(
    name: str,
    fn: Callable[..., object],
    call: Callable[[Callable[..., object]], Callable[[], object]] | None = None,
    **kw,
) -> Candidate:
    """A candidate that runs ``torch.compile(fn)`` (static shapes, graph breaks allowed).

    Args:
        name: shown in the table (``"torch.compile(reference_rms_norm_fwd)"``).
        fn: the PyTorch code to compile; it takes no arguments unless ``call`` is given.
        call: builds the timed zero-argument callable from the compiled function (a forward
            and backward: ``lambda f: lambda: torch.autograd.grad(f(x), x, dy)``); None times
            the compiled ``fn`` itself.
        kw: the other :class:`Candidate` fields (``bytes``, ``access``, targets).

    Compiling is lazy: nothing compiles until the harness warms the candidate up.

    Example::

        opt = torch.optim.AdamW(params, lr=1e-3)  # PyTorch's compiled-optimizer recipe
        compiled("torch.compile(AdamW.step)", lambda: opt.step(), bytes=28 * n)
    """
    fast = torch.compile(fn, dynamic=False)
    return Candidate(name, call(fast) if call is not None else fast, compiled=True, **kw)


@dataclass(frozen=True)
class Enough:
    """When a case has run enough rounds: the rule that sizes a ratio's 95% interval.

    After ``Options.rounds`` rounds, ``step`` more run at a time while some candidate's 95%
    interval of its ratio to the baseline (:func:`~mpnb.lab.stats.median_ci` of the per-round
    ratios) is wider than ``half_width`` of its ratio on either side, until the case has run
    ``max_rounds`` rounds or ``max_s`` seconds of rounds (the first ``Options.rounds`` always
    run). ``--quick`` ignores it.

    Args:
        half_width: the widest interval accepted, ``(hi - lo) / 2`` as a fraction of the
            median ratio (0.02: "within 2%").
        max_rounds: the most rounds.
        max_s: the most seconds of timed rounds (warm-up and compiling not counted).
        step: rounds added at a time.

    Example::

        Case("adam", "GPT", [base, ours], enough=Enough(half_width=0.02, max_rounds=40))
    """

    half_width: float = 0.02
    max_rounds: int = 40
    max_s: float = 1.0
    step: int = 5


@dataclass
class Case:
    """A comparison: ``candidates[0]`` is the PyTorch baseline, the others are compared with it.

    Args:
        name: what is compared (``"unscale bf16->fp32"``).
        workload: the data it runs on (``"(a) GPT 20M/75"``).
        candidates: baseline first.
        bandwidth_numel: fp32 elements of the same-run bandwidth baselines (usually the
            workload's element count); 0 runs none.
        device: where the bandwidth buffers live (the candidates' tensors are the suite's).
        min_rounds: rounds this case takes at least (outside ``--quick``): a time difference
            (``max_extra_s``) of a few percent of the times needs more rounds than a ratio.
        enough: the rule that adds rounds until the ratios' intervals are narrow
            (:class:`Enough`), or None for ``Options.rounds`` rounds.
        round_time: seconds each callable runs per round in this case (None:
            ``Options.round_time``); a GPU kernel of microseconds needs no 20 ms rounds.
        skipped: why this case cannot run here (``"needs 6.2 GiB of GPU memory, 3.1 GiB
            free"``): nothing runs and each candidate's row says so (status ``SKIPPED``).
    """

    name: str
    workload: str
    candidates: Sequence[Candidate]
    bandwidth_numel: int = 0
    device: str = "cpu"
    min_rounds: int = 0
    enough: Enough | None = None
    round_time: float | None = None
    skipped: str = ""

    @property
    def label(self) -> str:
        """``"<name> [<workload>]"``: what ``--filter`` matches against."""
        return f"{self.name} [{self.workload}]"


@dataclass(frozen=True)
class Options:
    """How hard to measure; suites read ``quick``, ``scale`` and ``device``.

    Args:
        rounds: timed rounds per case.
        warmup: untimed calls of each callable before the rounds.
        round_time: seconds each callable runs per round (sets the call count, at least 1).
        quick: a fast, rough run; suites may also use fewer cases.
        scale: multiplies the suite's workload sizes (tests run with tiny ones).
        device: the device suites should put their tensors on.
        filter: run only cases whose :attr:`Case.label` contains this substring.
        threads: ``torch.set_num_threads`` for the run (restored after), or None to keep it.
        compile: time the cases' ``torch.compile`` candidates (each compiles first: seconds
            to minutes); False leaves them out.
    """

    rounds: int = 15
    warmup: int = 2
    round_time: float = 0.02
    quick: bool = False
    scale: float = 1.0
    device: str = "cpu"
    filter: str = ""
    threads: int | None = None
    compile: bool = True

    @classmethod
    def make(
        cls, quick: bool = False, rounds: int | None = None, compile: bool | None = None, **kw
    ) -> Options:
        """Defaults for a full run, or for ``quick`` (5 rounds, 1 warm-up, 5 ms per round).

        ``compile`` None means "not when quick": a quick run takes seconds, and one compiled
        candidate alone takes tens of seconds to compile on a CPU.
        """
        base = cls(rounds=5, warmup=1, round_time=0.005, quick=True) if quick else cls()
        fields = {**asdict(base), **kw, "compile": not quick if compile is None else compile}
        if rounds is not None:
            fields["rounds"] = rounds
        if fields["rounds"] < 1:
            raise ValueError(f"rounds must be at least 1, got {fields['rounds']}.")
        _check_options(fields["scale"], fields["threads"], fields["device"])
        return cls(**fields)


def _check_options(scale, threads, device) -> None:
    """Refuse a scale, thread count or device no run can use (ValueError naming the fix)."""
    if not is_positive_finite(scale):
        raise ValueError(
            f"--scale {scale!r}: workload sizes are multiplied by it, so it must be a positive "
            "number (e.g. 0.01 for tiny sizes, 1 for the suite's own); a scale of 0 or less "
            "would time empty workloads."
        )
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise ValueError(
            f"--threads {threads!r}: need a positive thread count (e.g. --threads 1), or leave "
            "it out to keep torch's."
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(
            f"--device {device!r} is not a device the suites run on; use --device cpu or "
            "--device cuda (cuda:N)."
        )


@dataclass
class Row:
    """One line of the table (and one dict of the JSON): a candidate's result in a case.

    ``role`` is ``"baseline"``, ``"candidate"`` or ``"bandwidth"``. Times are seconds per
    call; ``ratio`` is the median of per-round ``baseline / this`` (above 1: faster than
    PyTorch), ``ratio_iqr`` its spread and ``ratio_lo``/``ratio_hi`` the 95% bootstrap interval
    of that median (None with fewer than 3 rounds); ``bw_frac`` is the median per-round fraction of
    the ``bw_ref`` bandwidth; ``extra_s`` is the median per-round time above the baseline's;
    ``extra_ratio`` is the median per-round ``(this - baseline) / (extra_vs - baseline)``;
    ``status`` is ``"PASS"``/``"MISS"`` against the targets, ``"SKIPPED"`` (the case could
    not run here: ``error`` says why) or ``""``; ``rounds`` is the rounds the case ran;
    ``preempt_per_call`` counts the OS's involuntary context switches of the process per call
    (well above 0: the machine is contended and a parallel region waited for a preempted thread).
    A ``torch.compile`` candidate also has ``compile_s``, the time of its calls that compiled
    (``compile_calls`` of them; ``compile_cache`` is ``"cached"`` when inductor's on-disk cache
    held every graph), which no other field includes; one whose compile failed has status
    ``"ERROR"``, the reason in ``error`` and no times (NaN; ``null`` in the JSON).
    A candidate with an :class:`InCache` roofline has ``cache_gbps`` (its in-cache throughput),
    ``cache_frac`` (the median per-round fraction of the same-run bandwidth baseline's GB/s)
    and ``bound``: ``"compute"`` when ``cache_frac`` is below :data:`COMPUTE_BOUND` (the kernel
    cannot reach that share of the bandwidth even from cache), else ``"memory"``.
    A candidate that declares its ``flops`` has ``tflops``, its achieved TFLOP/s at the median
    time; ``note`` is the candidate's own (how it runs here).
    """

    suite: str
    case: str
    workload: str
    candidate: str
    role: str
    median_s: float
    iqr_s: float
    rounds: int
    calls_per_round: int = 0
    ratio: float | None = None
    ratio_iqr: float | None = None
    target: float | None = None
    bytes: int = 0
    gbps: float | None = None
    bw_ref: str = ""
    bw_frac: float | None = None
    bw_target: float | None = None
    extra_s: float | None = None
    extra_target_s: float | None = None
    extra_vs: str = ""
    extra_ratio: float | None = None
    extra_ratio_target: float | None = None
    status: str = ""
    preempt_per_call: float = 0.0
    times_s: tuple[float, ...] = ()
    compile_s: float | None = None
    compile_calls: int = 0
    compile_cache: str = ""
    error: str = ""
    cache_gbps: float | None = None
    cache_frac: float | None = None
    bound: str = ""
    ratio_lo: float | None = None
    ratio_hi: float | None = None
    flops: int = 0
    tflops: float | None = None
    note: str = ""

    def to_dict(self) -> dict:
        """The row as plain JSON-ready data (NaN times of an ``ERROR`` row as None)."""
        d = asdict(self)
        d["times_s"] = list(self.times_s)
        for k in ("median_s", "iqr_s"):
            if d[k] != d[k]:
                d[k] = None
        return d


# ---- running a case ------------------------------------------------------------------------


def _bandwidth_candidates(case: Case) -> dict[str, Candidate]:
    kinds = {c.access for c in case.candidates if c.bytes}
    n = case.bandwidth_numel
    if not n or not kinds:
        return {}
    a = torch.ones(n, dtype=torch.float32, device=case.device)
    b = torch.ones(n, dtype=torch.float32, device=case.device)
    out = {}
    if RMW in kinds:  # s tiny: a grows slowly, never overflows nor turns denormal
        out[RMW] = Candidate(_BW_NAMES[RMW], lambda: a.add_(b, alpha=1e-7), 12 * n, RMW)
    if COPY in kinds:
        out[COPY] = Candidate(_BW_NAMES[COPY], lambda: a.copy_(b), 8 * n, COPY)
    if READ in kinds:
        out[READ] = Candidate(_BW_NAMES[READ], b.sum, 4 * n, READ)
    return out


def _status(row: Row) -> str:
    checks = []
    if row.target is not None and row.ratio is not None:
        checks.append(row.ratio >= row.target)
    if row.bw_target is not None and row.bw_frac is not None:
        checks.append(row.bw_frac >= row.bw_target)
    if row.extra_target_s is not None and row.extra_s is not None:
        checks.append(row.extra_s <= row.extra_target_s)
    if row.extra_ratio_target is not None and row.extra_ratio is not None:
        checks.append(row.extra_ratio <= row.extra_ratio_target)
    return "" if not checks else ("PASS" if all(checks) else "MISS")


def _warm_compiled(cands: Sequence[Candidate]) -> tuple[dict[int, _compile.Warm], dict[int, str]]:
    """Warm up the compiled candidates (after forgetting earlier cases' graphs): their compile
    times, and the reasons of those that failed, by index."""
    warm: dict[int, _compile.Warm] = {}
    failed: dict[int, str] = {}
    if any(c.compiled for c in cands):
        _compile.reset()
    for i, c in enumerate(cands):
        if not c.compiled:
            continue
        try:
            warm[i] = _compile.warm_up(c.fn)
        except Exception as e:  # any compile error becomes this candidate's row, not a crash
            failed[i] = _compile.failure(e)
    return warm, failed


def run_case(case: Case, opts: Options, suite: str = "") -> list[Row]:
    """Time ``case`` round-robin with its bandwidth baselines; one :class:`Row` per callable.

    Rows come in the case's order (baseline first), then the bandwidth baselines. Compiled
    candidates are left out unless ``opts.compile``; each is warmed up first (its compile time
    goes to its row's ``compile_s``), and one that fails to compile gets an ``ERROR`` row.
    """
    if not case.candidates:
        raise ValueError(f"case {case.label!r} has no candidates.")
    if case.skipped:
        return [_error_row(suite, case, c, case.skipped, "SKIPPED") for c in case.candidates]
    if case.min_rounds > opts.rounds and not opts.quick:
        opts = replace(opts, rounds=case.min_rounds)
    if case.round_time is not None:
        opts = replace(opts, round_time=case.round_time)
    listed = [c for c in case.candidates if opts.compile or not c.compiled]
    warm, failed = _warm_compiled(listed)
    if 0 in failed:
        raise RuntimeError(f"case {case.label!r}: its baseline {failed[0]}")
    ours = [c for i, c in enumerate(listed) if i not in failed]
    bw = _bandwidth_candidates(case)
    rooflines = _in_cache_candidates(ours)
    cands = [*ours, *bw.values(), *(x for pair in rooflines.values() for x in pair)]
    start = time.monotonic()
    times, numbers, preempted = time_rounds(cands, opts)
    if case.enough is not None and not opts.quick:
        times, preempted = _more_rounds(
            case.enough, cands, len(ours), opts, start, times, numbers, preempted
        )
    rounds = len(times[0]) if times else opts.rounds
    cache_t = dict(zip([c.name for c in cands], times, strict=True))
    by_name = dict(zip([c.name for c in cands], times, strict=True))
    bw_t = {kind: times[len(ours) + j] for j, kind in enumerate(bw)}
    timed = iter(range(len(cands)))
    rows = []
    for i, c in enumerate([*listed, *bw.values()]):
        if i in failed:
            rows.append(_error_row(suite, case, c, failed[i]))
            continue
        j = next(timed)
        role = "baseline" if i == 0 else "candidate" if i < len(listed) else "bandwidth"
        t = times[j]
        row = Row(suite, case.name, case.workload, c.name, role, median(t), iqr(t), rounds)
        row.calls_per_round, row.bytes, row.note = numbers[j], c.bytes, c.note
        if c.flops:
            row.flops, row.tflops = c.flops, c.flops / row.median_s / 1e12
        row.preempt_per_call, row.times_s = preempted[j], tuple(t)
        if role == "candidate":
            _compare(row, c, t, times[0], by_name)
        if c.bytes:
            _bandwidth(row, c, t, bw, bw_t)
        if c.name in rooflines:
            _roofline(row, c, [cache_t[x.name] for x in rooflines[c.name]], bw, bw_t)
        if i in warm:
            row.compile_s, row.compile_calls = warm[i].seconds, warm[i].calls
            row.compile_cache = warm[i].cache
        row.status = _status(row)
        rows.append(row)
    return rows


def _wide(enough: Enough, times: list[list[float]], n_ours: int) -> bool:
    """True while some candidate's 95% interval of its ratio is wider than the rule allows."""
    for t in times[1:n_ours]:
        ratios = per_round_ratios(times[0], t)
        lo, hi = median_ci(ratios)
        if not (hi - lo) / 2 <= enough.half_width * median(ratios):  # nan: too few rounds
            return True
    return False


def _more_rounds(enough, cands, n_ours, opts, start, times, numbers, preempted):
    """Add rounds to ``times`` by ``enough``'s rule (:class:`Enough`): all the rounds' times,
    and the preemptions per call over all of them."""
    done = len(times[0]) if times else 0
    weighted = [p * done for p in preempted]  # preemptions per call x rounds, summed
    while (
        done < enough.max_rounds
        and time.monotonic() - start < enough.max_s
        and _wide(enough, times, n_ours)
    ):
        k = min(enough.step, enough.max_rounds - done)
        more, _, pre = time_rounds(cands, replace(opts, rounds=k), numbers=numbers, first=done)
        times = [a + b for a, b in zip(times, more, strict=True)]
        weighted = [w + p * k for w, p in zip(weighted, pre, strict=True)]
        done += k
    return times, [w / max(done, 1) for w in weighted]


def _in_cache_candidates(cands: Sequence[Candidate]) -> dict[str, tuple[Candidate, Candidate]]:
    """The two slices of each candidate that has an in-cache roofline, as timed callables."""
    out = {}
    for c in cands:
        if c.in_cache is not None:
            ic = c.in_cache
            out[c.name] = (
                Candidate(f"{c.name} [in cache]", ic.fn, ic.bytes, c.access),
                Candidate(f"{c.name} [in cache, small]", ic.small_fn, ic.small_bytes, c.access),
            )
    return out


def _roofline(row: Row, c: Candidate, pair: list[list[float]], bw, bw_t) -> None:
    """Fill the row's in-cache throughput (marginal: the small slice's time subtracted, round
    by round), its fraction of the same-run bandwidth and the verdict."""
    ic = c.in_cache
    extra = ic.bytes - ic.small_bytes
    ref_t = bw_t.get(c.access, [float("nan")] * len(pair[0]))
    # rounds where the larger slice did not take longer (a preempted small call) say nothing
    cores = torch.get_num_threads() if ic.one_thread else 1
    kept = [(cores * extra / (t - s), r) for t, s, r in zip(*pair, ref_t, strict=True) if t > s]
    if 2 * len(kept) < len(pair[0]):  # most rounds: no figure rather than a noisy one
        return
    per_round = [g for g, _ in kept]
    row.cache_gbps = median(per_round) / 1e9
    if c.access in bw_t:
        ref = bw[c.access]
        row.cache_frac = median(per_round_ratios(per_round, [ref.bytes / r for _, r in kept]))
        row.bound = "compute" if row.cache_frac < COMPUTE_BOUND else "memory"


def _error_row(suite: str, case: Case, c: Candidate, reason: str, status: str = "ERROR") -> Row:
    """A row with no times: a compile that failed (``ERROR``) or a case that cannot run here
    (``SKIPPED``), ``reason`` saying why."""
    nan = float("nan")
    role = "baseline" if c is case.candidates[0] else "candidate"
    row = Row(suite, case.name, case.workload, c.name, role, nan, nan, 0)
    row.bytes, row.status, row.error, row.note = c.bytes, status, reason, c.note
    return row


def _compare(row: Row, c: Candidate, t: list[float], base_t: list[float], by_name) -> None:
    """Fill the row's speed-up, its time above the baseline's and the extra-cost ratio."""
    row.ratio, row.ratio_iqr = ratio_summary(base_t, t)
    lo, hi = median_ci(per_round_ratios(base_t, t))
    if lo == lo:  # nan with fewer than 3 rounds: no interval
        row.ratio_lo, row.ratio_hi = lo, hi
    row.target = c.target
    row.extra_s = median([x - b for x, b in zip(t, base_t, strict=True)])
    row.extra_target_s = c.max_extra_s
    if c.extra_vs is not None:
        other = by_name[c.extra_vs]
        row.extra_vs = c.extra_vs
        row.extra_ratio = median(
            [
                (x - b) / (o - b) if o != b else float("inf")
                for x, o, b in zip(t, other, base_t, strict=True)
            ]
        )
        row.extra_ratio_target = c.max_extra_ratio


def _bandwidth(row: Row, c: Candidate, t: list[float], bw, bw_t) -> None:
    """Fill the row's GB/s and its per-round fraction of the matching bandwidth baseline's."""
    row.gbps = c.bytes / row.median_s / 1e9
    if c.access in bw_t:
        ref = bw[c.access]
        row.bw_frac = median(
            per_round_ratios([c.bytes / x for x in t], [ref.bytes / x for x in bw_t[c.access]])
        )
        row.bw_ref = ref.name
        row.bw_target = c.bw_target


def run_cases(
    cases: Iterable[Case],
    opts: Options,
    suite: str = "",
    on_rows: Callable[[list[Row]], None] | None = None,
) -> list[Row]:
    """Run each case (skipping those ``opts.filter`` excludes); ``on_rows`` sees each case's rows.

    Cases are consumed one at a time, so a suite that yields them from a generator holds only
    one workload's tensors at once.
    """
    rows: list[Row] = []
    for case in cases:
        if opts.filter and opts.filter.lower() not in case.label.lower():
            continue
        got = run_case(case, opts, suite)
        rows.extend(got)
        if on_rows is not None:
            on_rows(got)
    return rows
