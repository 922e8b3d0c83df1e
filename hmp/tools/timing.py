"""Step times relative to fp32, judged only where the machine let them be
measured; and the one way the benchmarks take their samples.

One unit everywhere: a configuration's time divided by fp32's, so below 1
is faster. Samples come in adjacent pairs (``paired``): the two members of
a pair run one after the other, in alternating order, so load that lasts a
pair multiplies both and cancels in its ratio, and the median of the pairs'
ratios is the time relative to fp32.

Load in bursts longer than a step but not a pair reverses such ratios (a
demo said 0.22x, then 1.16x, on a 2-core machine at load 2-5), so a sample
also says what the machine did while it ran (host.Sample: its threads'
run-queue waits, steal). A pair counts only when neither run lost more than
MARGIN of its time to other programs (``contended``); a comparison most of
whose pairs were contended, or with fewer than MIN_PAIRS clean ones, is
``busy``: no verdict, and the sentence (speed.py) says why and how to get
one. Where a comparison has a control (the same lists timed twice, two
arms), the control's two arms must agree within the margin too.

A difference is measured only then, when the clean pairs' middle half (25th
to 75th percentile of their ratios) lies wholly outside the band of MARGIN
around 1.0 AND the run says the same twice: the first half of the pairs and
the second, each judged alone by its median, lie outside the band on the
same side. Everything a user reads about speed is worded in speed.py, from
the Ratio here.

And one way of taking the samples, the only one benchmarks/*.py use (a test
reads their source for any other clock): ``per_call`` times back-to-back
calls between two device synchronisations, ``interleaved`` takes one sample
of every configuration per round, the order rotated round by round so none
always runs first (after another's allocations, in its caches), and a
``Stopwatch`` gives the seconds a progress line or a one-shot duration says.
``quartiles`` and ``iqr_rel`` state the spread of raw samples (not of
ratios: that is Ratio's).
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from typing import Callable, Iterable, NamedTuple, Sequence

import torch

from hmp.tools import host as host_mod
from hmp.tools.host import Sample

MIN_PAIRS = 3  # fewer pairs have no middle half worth the name
# the tools' own margin: a step within 2 % of fp32's time (0.98x to 1.02x) is not told from fp32's; and the most
# of a run's time other programs may have taken (its threads' waits for a CPU, steal) for it to count
MARGIN = 0.02
# a change tune keeps for its speed must beat chance this clearly: the share of pairs faster with it would
# come up by chance, with no difference at all, less than once in fifty (a one-sided sign test)
SURE = 0.02


class Load(NamedTuple):
    """What the machine did during a comparison's pairs (host.Sample's counters over every pair taken):
    ``taken`` pairs, ``contended`` of them left out, the runs' threads' run-queue wait as a share of the
    runs' wall time per torch thread (the average thread's), the steal as a share of the machine's CPU
    time over them (None: not reported here), the most tasks runnable at a run's end, torch's threads
    and this process's CPUs."""

    taken: int
    contended: int
    waited: float | None
    stolen: float | None
    runnable: int | None
    threads: int | None
    cpus: int


class Ratio(NamedTuple):
    """Time relative to fp32 from paired samples: the median of the clean pairs' ratios, the 25th and
    75th percentiles of them, and how many pairs; ``load``, what the machine did meanwhile (None: plain
    numbers, no host read); ``control``, the same lists timed twice (None: no control); ``timed``, a
    control's: what it timed twice, as a sentence names it (None: the same lists), set where it is made."""

    median: float
    low: float
    high: float
    pairs: int
    below: int = 0  # pairs whose ratio is below 1
    # the medians of the first and of the second half of the pairs, in the order taken: the run said twice
    # (None: not known, as for a Ratio written by hand)
    first: float | None = None
    second: float | None = None
    margin: float = MARGIN
    load: Load | None = None
    control: Ratio | None = None
    timed: str | None = None

    def side(self, value):
        """-1 below the band of ``margin`` around 1.0, +1 above it, 0 inside it."""
        return -1 if value < 1.0 - self.margin else 1 if value > 1.0 + self.margin else 0

    @property
    def busy(self):
        """Other programs took too much of the runs for a verdict: most pairs contended, or fewer than
        MIN_PAIRS clean ones left where some were contended. A host that does not report its threads'
        waits is busy when it does not say how many tasks were runnable, or more were than it has CPUs."""
        load = self.load
        if load is None:
            return False
        if (load.stolen or 0.0) > self.margin:  # a hypervisor took the machine's CPUs (judged over all the runs)
            return True
        if load.waited is None:
            return load.runnable is None or load.runnable > load.cpus
        return load.contended > 0 and (self.pairs < MIN_PAIRS or 2 * load.contended > load.taken)

    @property
    def control_agrees(self):
        """No control, or the same lists timed twice agree: not busy, enough pairs, and their median within
        the margin of 1.0."""
        c = self.control
        return c is None or (not c.busy and c.pairs >= MIN_PAIRS and self.side(c.median) == 0)

    @property
    def judged(self):
        """The machine let this comparison be judged: not busy, and its control (if any) agrees."""
        return not self.busy and self.control_agrees

    @property
    def outside_band(self):
        """-1 or +1 when the middle half lies wholly on one side outside the band, else 0."""
        if self.pairs < MIN_PAIRS:
            return 0
        low, high = self.side(self.low), self.side(self.high)
        return low if low == high else 0

    @property
    def halves_agree(self):
        """The first and the second half of the pairs, each alone, say the same as the whole: what a run
        repeated would say (True when the halves are not known)."""
        if self.first is None or self.second is None:
            return True
        return self.side(self.first) == self.side(self.second) == self.outside_band

    def chance(self):
        """How likely as many pairs below 1 would be with no difference at all: each pair then below
        or above 1 as a coin falls (a one-sided sign test; 1.0 with no pair)."""
        return sum(math.comb(self.pairs, k) for k in range(self.below, self.pairs + 1)) / 2**self.pairs

    @property
    def surely_faster(self):
        """Faster, and by more than chance: what tune asks of an op before it keeps it for its speed.
        With 10 pairs, 9 of them below 1; with 5 or fewer, never (a coin falls 5 times alike 1 in 32)."""
        return self.faster and self.chance() < SURE

    @property
    def measurable(self):
        """Judged (the machine let it be), enough pairs, a middle half wholly outside the band of
        ``margin`` around 1.0, and both halves of the run on that side too."""
        return self.judged and self.outside_band != 0 and self.halves_agree

    @property
    def faster(self):
        return self.measurable and self.outside_band < 0

    @property
    def slower(self):
        return self.measurable and self.outside_band > 0

    def as_dict(self):
        """A plain dict for JSON (load and control as dicts too); from_dict() reads it back."""
        d = self._asdict()
        d["load"] = self.load._asdict() if self.load is not None else None
        d["control"] = self.control.as_dict() if self.control is not None else None
        return d

    @classmethod
    def from_dict(cls, d):
        d = dict(d)
        d["load"] = Load(**d["load"]) if d.get("load") else None
        d["control"] = cls.from_dict(d["control"]) if d.get("control") else None
        return cls(**d)


def _seconds(sample):
    return sample.seconds if isinstance(sample, Sample) else sample


def _clean(pair, margin):
    """Neither run of the pair lost more than ``margin`` of its time to other programs (a plain number,
    or a host that does not report its waits: nothing says it did)."""
    for sample in pair:
        share = sample.contention() if isinstance(sample, Sample) else None
        if share is not None and share > margin:
            return False
    return True


def load_of(pairs, contended):
    """The Load of ``pairs`` (of host.Samples; None for plain numbers), ``contended`` of them left out."""
    samples = [s for pair in pairs for s in pair if isinstance(s, Sample)]
    if not samples:
        return None

    def share(values, of):
        known = [(v, t) for v, t in zip(values, of) if v is not None]
        total = sum(t for _, t in known)
        return sum(v for v, _ in known) / total if known and total > 0 else None

    runnable = [s.runnable for s in samples if s.runnable is not None]
    threads = [s.threads for s in samples if s.threads is not None]
    return Load(
        len(pairs),
        contended,
        share([s.waited for s in samples], [s.wall * max(s.threads or 1, 1) for s in samples]),
        share([s.stolen for s in samples], [s.wall * s.cpus for s in samples]),
        max(runnable) if runnable else None,
        max(threads) if threads else None,
        max(s.cpus for s in samples),
    )


def ratio(
    fp32: Sequence, other: Sequence, margin: float = MARGIN, control: Ratio | None = None, timed: str | None = None
) -> Ratio | None:
    """The Ratio of ``other``'s times to ``fp32``'s, paired by position (both taken in pairs, paired(),
    in the order taken: the first half of the pairs and the second are judged apart too). Samples are
    seconds or host.Samples; a pair in which a run lost more than ``margin`` of its time to other
    programs is left out (load says how many). None when there is no pair or an fp32 time is not
    positive. ``timed``: a control's name for what it timed twice (Ratio.timed)."""
    pairs = list(zip(fp32, other))
    if not pairs or any(_seconds(a) <= 0 for a, _ in pairs):
        return None
    clean = [p for p in pairs if _clean(p, margin)]
    load = load_of(pairs, len(pairs) - len(clean))
    taken = [_seconds(b) / _seconds(a) for a, b in (clean or pairs)]  # none clean: the numbers, for the record
    kept = len(clean)
    ratios = sorted(taken)
    below = sum(r < 1.0 for r in ratios) if clean else 0
    if len(ratios) == 1:
        return Ratio(
            ratios[0], ratios[0], ratios[0], kept, below, margin=margin, load=load, control=control, timed=timed
        )
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    half = len(taken) // 2
    first, second = statistics.median(taken[:half]), statistics.median(taken[half:])
    return Ratio(statistics.median(ratios), low, high, kept, below, first, second, margin, load, control, timed)


@contextlib.contextmanager
def collector_paused():
    """Python's garbage collector off for a timed block (as timeit does): a collection would land on
    whichever call happens to allocate, and make it look slow."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _nothing():
    pass


def per_call(fn, calls=1, sync=None, clock=time.perf_counter):
    """Seconds per call of ``calls`` back-to-back calls of ``fn()``. ``sync`` (a device's
    synchronise; None: nothing, as on a CPU) runs before the clock starts, so kernels queued
    earlier are not counted, and before it stops, so the calls' own are.

    The collector is left as the caller has it: a step's collections are part of what a step
    costs (a caller that wants a sample to pay for its own garbage only collects before it), and
    the benchmarks' numbers were all taken so; a caller timing calls too small to own a
    collection wraps them in collector_paused()."""
    sync = sync or _nothing
    sync()
    start = clock()
    for _ in range(calls):
        fn()
    sync()
    return (clock() - start) / calls


def per_call_wall_and_thread(fn, calls=1, wall=time.perf_counter, thread=time.thread_time):
    """``(wall, thread)`` seconds per call of ``calls`` back-to-back calls of ``fn()``: the wall clock
    and the calling thread's CPU time, read around the same calls. On a host other processes load,
    the thread's CPU time leaves out the time it waited for a core, so its ratios survive load that
    wall ratios do not (on a CPU run with one torch thread: work in torch's own threads, or on a
    device, is not the calling thread's)."""
    start = wall(), thread()
    for _ in range(calls):
        fn()
    return (wall() - start[0]) / calls, (thread() - start[1]) / calls


def rotated(names: Sequence, i: int) -> list:
    """``names`` started at its ``i``-th (modulo its length): round i's order (A B C, B C A, ...)."""
    k = i % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


def interleaved(
    samplers: dict[str, Callable[[], object]],
    rounds: int,
    rotate: bool = True,
    warmup: int = 0,
    after_round: Callable[[int, dict], None] | None = None,
) -> dict[str, list]:
    """``name -> [its sample per round]``: ``rounds`` rounds, each calling every sampler once (a
    sampler returns one sample). With ``rotate`` round i starts at the i-th name (rotated()), so
    load from elsewhere and what one configuration leaves behind fall on each in turn; without,
    every round runs in the given order. ``warmup`` rounds run first, in the given order, and are
    not kept. ``after_round(i, samples)``: called after timed round i (0-based), for progress."""
    names = list(samplers)
    samples = {name: [] for name in names}
    for _ in range(warmup):
        for name in names:
            samplers[name]()
    for i in range(rounds):
        for name in rotated(names, i) if rotate else names:
            samples[name].append(samplers[name]())
        if after_round is not None:
            after_round(i, samples)
    return samples


class Paired(NamedTuple):
    """What paired() took: ``pairs``, name -> [(reference sample, its sample)] in the order taken, and
    ``reference``, every reference sample once (one reference sample may be in two names' pairs)."""

    pairs: dict
    reference: list

    def samples(self, name):
        """``name``'s own samples, in the order taken."""
        return [b for _, b in self.pairs[name]]

    def ratio(self, name, margin=MARGIN, control=None):
        """``name``'s Ratio to the reference, from its pairs; ``control``: a Ratio of the same lists timed
        twice (control()), which must agree for a verdict."""
        got = self.pairs[name]
        return ratio([a for a, _ in got], [b for _, b in got], margin, control)

    def control(self, first, second, margin=MARGIN, timed=None):
        """The same lists timed twice, as ``first`` and ``second`` (each paired with the reference in the
        same rounds): ``second``'s samples relative to ``first``'s, round by round (1.0 when this machine
        times alike what is alike); ``timed``, what sentences call them (Ratio.timed)."""
        return ratio(self.samples(first), self.samples(second), margin, timed=timed)


def paired(
    samplers: dict[str, Callable[[], float]],
    reference: str,
    rounds: int,
    warmup: int = 0,
    after_round: Callable[[int], None] | None = None,
) -> Paired:
    """Samples of every configuration in adjacent pairs with ``reference`` (fp32): each round takes, for
    the others two at a time, the reference between them (``A ref B``, the next round ``B ref A``: the
    reference sample is adjacent to both), or for one left over, the pair in alternating order (``ref C``,
    then ``C ref``), so neither member always runs first. Load that lasts a pair multiplies both of its
    members and cancels in the pair's ratio. ``warmup`` rounds run first and are not kept;
    ``after_round(i)`` is called after timed round i (0-based), for progress."""
    others = [name for name in samplers if name != reference]
    groups = [others[j : j + 2] for j in range(0, len(others), 2)] or [[]]
    pairs = {name: [] for name in others}
    kept = []
    for i in range(warmup + rounds):
        for group in groups:
            group = group if i % 2 == 0 else group[::-1]
            order = [group[0], reference, *group[1:]] if len(group) == 2 else [reference, *group]
            if len(group) == 1 and i % 2:
                order = order[::-1]
            got = {name: samplers[name]() for name in order}
            if i < warmup:
                continue
            kept.append(got[reference])
            for name in group:
                pairs[name].append((got[reference], got[name]))
        if i >= warmup and after_round is not None:
            after_round(i - warmup)
    return Paired(pairs, kept)


def matmul_ratio(low=None, device="cpu", shape=(512, 512, 1024), rounds=8, host=None):
    """A matrix product of ``shape`` (rows, inner, columns) in ``low`` (bfloat16 by default) relative to
    float32 on ``device``, timed in adjacent pairs (paired(), one warm-up round; each sample host.measure's,
    with what the machine did meanwhile, read from ``host``): what this machine's arithmetic in the lower
    dtype gains or loses, measured now rather than read from its name."""
    low = low or torch.bfloat16
    rows, inner, cols = shape
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows, inner, generator=gen), torch.randn(inner, cols, generator=gen)
    operands = {
        name: (a.to(device, dtype), b.to(device, dtype)) for name, dtype in (("fp32", torch.float32), ("low", low))
    }
    samplers = {
        name: (lambda x=x, w=w: host_mod.measure(lambda: torch.mm(x, w), device, host))
        for name, (x, w) in operands.items()
    }
    return paired(samplers, "fp32", rounds, warmup=1).ratio("low")


class Stopwatch:
    """Seconds since it was started (``elapsed``): what a progress line (``(123 s)``) or a one-shot
    duration says. Not for samples: those are per_call's, between device synchronisations."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.start = clock()

    @property
    def elapsed(self) -> float:
        return self.clock() - self.start


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """(25th, 75th percentile) of raw samples (statistics.quantiles' default method); one value is
    both."""
    if len(values) < 2:
        return values[0], values[0]
    low, _, high = statistics.quantiles(values, n=4)
    return low, high


def iqr_rel(values: Iterable[float]) -> float:
    """Interquartile range over the median: how noisy raw samples were (0.05: 5 %); nan for fewer
    than 4, which have no quartiles worth the name."""
    values = list(values)
    if len(values) < 4:
        return float("nan")
    low, high = quartiles(values)
    return (high - low) / statistics.median(values)
