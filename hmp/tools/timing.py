"""Step times relative to fp32, with the spread that says when they are noise;
and the one way the benchmarks take their samples.

One unit everywhere: a configuration's time divided by fp32's, so below 1
is faster. Samples come interleaved (an fp32 run, a run under the lists, an
fp32 run, ...), so the i-th sample of each was taken at about the same
moment; a ratio per pair cancels load from elsewhere that lasts longer than
a pair, and the median of the pairs' ratios is the time relative to fp32.

One statement of noise, the same in every tool: the middle half of the
pairs' ratios (25th to 75th percentile). A difference is measured only when
that middle half lies wholly outside the band of MARGIN around 1.0 (the
tools' own margin: 2 % of fp32's time is not told from none) AND the run
says the same twice: the first half of the pairs and the second half, each
judged alone by its median, lie outside the band on the same side. Then it
is said with its size and that range (``0.62x fp32's time (middle half of
10 pairs: 0.58x to 0.66x)``); otherwise, or with fewer than MIN_PAIRS
pairs, no difference was measured, and that is said with the range and
why. Pairs are taken adjacent (``paired``): the two members of a pair run
one after the other, in alternating order, so load that lasts a pair
multiplies both and cancels in its ratio; a burst that starts or ends
inside a pair spoils that one pair, which the middle half leaves out.

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

MIN_PAIRS = 3  # fewer pairs have no middle half worth the name
UNCLEAR = "no measurable difference"
# the tools' own margin: a step within 2 % of fp32's time (0.98x to 1.02x) is not told from fp32's
MARGIN = 0.02
# a change tune keeps for its speed must beat chance this clearly: the share of pairs faster with it would
# come up by chance, with no difference at all, less than once in fifty (a one-sided sign test)
SURE = 0.02


class Ratio(NamedTuple):
    """Time relative to fp32 from paired samples: the median of the pairs'
    ratios, the 25th and 75th percentiles of them, and how many pairs."""

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

    def side(self, value):
        """-1 below the band of ``margin`` around 1.0, +1 above it, 0 inside it."""
        return -1 if value < 1.0 - self.margin else 1 if value > 1.0 + self.margin else 0

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
    def spread(self):
        """Half the middle half's width relative to the median."""
        return (self.high - self.low) / 2 / self.median if self.median > 0 else float("inf")

    @property
    def measurable(self):
        """Enough pairs, a middle half wholly outside the band of ``margin`` around 1.0, and both halves of
        the run on that side too."""
        return self.outside_band != 0 and self.halves_agree

    @property
    def faster(self):
        return self.measurable and self.outside_band < 0

    @property
    def slower(self):
        return self.measurable and self.outside_band > 0

    def unmeasured_because(self):
        """Why no difference was measured, for the sentence (empty when one was, or the range says it)."""
        if self.pairs < MIN_PAIRS or self.measurable:
            return ""
        if self.outside_band == 0:
            if self.high < 1.0 or self.low > 1.0:
                return f"; within the {self.margin:.0%} margin of 1.0"
            return ""
        return (
            f"; the first half of the pairs says {self.first:.2f}x and the second {self.second:.2f}x, "
            "not the same when repeated"
        )

    def middle_half(self):
        """``middle half of 10 pairs: 0.58x to 0.66x`` (or why there is none)."""
        if self.pairs < MIN_PAIRS:
            return f"{self.pairs} pair{'s' * (self.pairs != 1)}, too few to tell"
        return f"middle half of {self.pairs} pairs: {self.low:.2f}x to {self.high:.2f}x"

    def words(self, of="fp32's time"):
        """``0.62x fp32's time (middle half of 10 pairs: 0.58x to 0.66x)``, or
        ``no measurable difference (middle half of 10 pairs: 0.95x to 1.04x)``;
        ``of``: what the ratio is relative to."""
        if not self.measurable:
            return f"{UNCLEAR} ({self.middle_half()}{self.unmeasured_because()})"
        return f"{self.median:.2f}x {of} ({self.middle_half()})"

    def short(self):
        """The same for a table cell or a chart: ``0.62x (0.58-0.66)``, or ``no measurable difference (0.95-1.04)``."""
        span = f"{self.low:.2f}-{self.high:.2f}" if self.pairs >= MIN_PAIRS else "too few pairs"
        return f"{self.median:.2f}x ({span})" if self.measurable else f"{UNCLEAR} ({span})"

    def direction(self):
        """``faster``, ``slower`` or UNCLEAR."""
        return "faster" if self.faster else "slower" if self.slower else UNCLEAR


def ratio(fp32: Sequence[float], other: Sequence[float], margin: float = MARGIN) -> Ratio | None:
    """The Ratio of ``other``'s times to ``fp32``'s, paired by position
    (both taken in pairs, paired(), in the order taken: the first half of
    the pairs and the second are judged apart too); None when there is no
    pair or an fp32 time is not positive."""
    pairs = list(zip(fp32, other))
    if not pairs or any(a <= 0 for a, _ in pairs):
        return None
    taken = [b / a for a, b in pairs]
    ratios = sorted(taken)
    below = sum(r < 1.0 for r in ratios)
    if len(ratios) == 1:
        return Ratio(ratios[0], ratios[0], ratios[0], 1, below, margin=margin)
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    half = len(taken) // 2
    first, second = statistics.median(taken[:half]), statistics.median(taken[half:])
    return Ratio(statistics.median(ratios), low, high, len(ratios), below, first, second, margin)


def words(ratio_or_none):
    """Ratio.words(), or UNCLEAR when nothing was timed."""
    return f"{UNCLEAR} (not timed)" if ratio_or_none is None else ratio_or_none.words()


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

    def ratio(self, name, margin=MARGIN):
        """``name``'s Ratio to the reference, from its pairs."""
        got = self.pairs[name]
        return ratio([a for a, _ in got], [b for _, b in got], margin)


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


def matmul_ratio(low=None, device="cpu", shape=(512, 512, 1024), rounds=8, clock=time.perf_counter):
    """A matrix product of ``shape`` (rows, inner, columns) in ``low`` (bfloat16 by default) relative to
    float32 on ``device``, timed in adjacent pairs (paired(), one warm-up round): what this machine's
    arithmetic in the lower dtype gains or loses, measured now rather than read from its name."""
    low = low or torch.bfloat16
    rows, inner, cols = shape
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows, inner, generator=gen), torch.randn(inner, cols, generator=gen)
    operands = {
        name: (a.to(device, dtype), b.to(device, dtype)) for name, dtype in (("fp32", torch.float32), ("low", low))
    }
    sync = None
    if device != "cpu":
        accelerator = getattr(torch, str(device).split(":")[0], None)
        sync = getattr(accelerator, "synchronize", None)
    samplers = {
        name: (lambda x=x, w=w: per_call(lambda: torch.mm(x, w), sync=sync, clock=clock))
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
