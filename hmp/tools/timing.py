"""Step times relative to fp32, with the spread that says when they are noise;
and the one way the benchmarks take their samples.

One unit everywhere: a configuration's time divided by fp32's, so below 1
is faster. Samples come interleaved (an fp32 run, a run under the lists, an
fp32 run, ...), so the i-th sample of each was taken at about the same
moment; a ratio per pair cancels load from elsewhere that lasts longer than
a pair, and the median of the pairs' ratios is the time relative to fp32.

One statement of noise, the same in every tool: the middle half of the
pairs' ratios (25th to 75th percentile). When it lies wholly on one side of
1.0 the difference is measured, and said with its size and that range
(``0.62x fp32's time (middle half of 10 pairs: 0.58x to 0.66x)``); when it
covers 1.0, or there are fewer than MIN_PAIRS pairs, no difference was
measured, and that is said with the range too.

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

MIN_PAIRS = 3  # fewer pairs have no middle half worth the name
UNCLEAR = "no measurable difference"
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
        """Enough pairs, and a middle half that lies wholly on one side of 1.0."""
        return self.pairs >= MIN_PAIRS and (self.high < 1.0 or self.low > 1.0)

    @property
    def faster(self):
        return self.measurable and self.high < 1.0

    @property
    def slower(self):
        return self.measurable and self.low > 1.0

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
            return f"{UNCLEAR} ({self.middle_half()})"
        return f"{self.median:.2f}x {of} ({self.middle_half()})"

    def short(self):
        """The same for a table cell or a chart: ``0.62x (0.58-0.66)``, or ``no measurable difference (0.95-1.04)``."""
        span = f"{self.low:.2f}-{self.high:.2f}" if self.pairs >= MIN_PAIRS else "too few pairs"
        return f"{self.median:.2f}x ({span})" if self.measurable else f"{UNCLEAR} ({span})"

    def direction(self):
        """``faster``, ``slower`` or UNCLEAR."""
        return "faster" if self.faster else "slower" if self.slower else UNCLEAR


def ratio(fp32: Sequence[float], other: Sequence[float]) -> Ratio | None:
    """The Ratio of ``other``'s times to ``fp32``'s, paired by position
    (both taken interleaved); None when there is no pair or an fp32 time is
    not positive."""
    pairs = list(zip(fp32, other))
    if not pairs or any(a <= 0 for a, _ in pairs):
        return None
    ratios = sorted(b / a for a, b in pairs)
    below = sum(r < 1.0 for r in ratios)
    if len(ratios) == 1:
        return Ratio(ratios[0], ratios[0], ratios[0], 1, below)
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return Ratio(statistics.median(ratios), low, high, len(ratios), below)


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
