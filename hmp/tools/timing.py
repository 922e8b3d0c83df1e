"""Step times relative to fp32, with the spread that says when they are noise.

One unit everywhere: a configuration's time divided by fp32's, so below 1
is faster. Samples come interleaved (an fp32 run, a run under the lists, an
fp32 run, ...), so the i-th sample of each was taken at about the same
moment; a ratio per pair cancels load from elsewhere that lasts longer than
a pair, and the median of the pairs' ratios is the time relative to fp32.
The spread is the middle half of those ratios; a ratio whose middle half
covers 1.0, or is wider than NOISE either side, is no measurable difference.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple, Sequence

NOISE = 0.25  # a middle half wider than +-25% of the median says nothing about the direction
MIN_PAIRS = 3  # fewer pairs have no middle half worth the name
UNCLEAR = "no measurable difference here"


class Ratio(NamedTuple):
    """Time relative to fp32 from paired samples: the median of the pairs'
    ratios, the 25th and 75th percentiles of them, and how many pairs."""

    median: float
    low: float
    high: float
    pairs: int

    @property
    def spread(self):
        """Half the middle half's width relative to the median: the ``+-`` shown."""
        return (self.high - self.low) / 2 / self.median if self.median > 0 else float("inf")

    @property
    def measurable(self):
        """Enough pairs, a middle half that lies wholly on one side of 1.0 and is no wider than NOISE."""
        return self.pairs >= MIN_PAIRS and (self.high < 1.0 or self.low > 1.0) and self.spread <= NOISE

    @property
    def faster(self):
        return self.measurable and self.high < 1.0

    @property
    def slower(self):
        return self.measurable and self.low > 1.0

    def words(self):
        """``0.62x fp32's time (+-4%)``, or UNCLEAR."""
        if not self.measurable:
            return UNCLEAR
        return f"{self.median:.2f}x fp32's time (+-{self.spread:.0%})"

    def short(self):
        """The same for a table cell or a chart: ``0.62x +-4%``, or UNCLEAR."""
        return f"{self.median:.2f}x +-{self.spread:.0%}" if self.measurable else UNCLEAR

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
    if len(ratios) == 1:
        return Ratio(ratios[0], ratios[0], ratios[0], 1)
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return Ratio(statistics.median(ratios), low, high, len(ratios))


def words(ratio_or_none):
    """Ratio.words(), or UNCLEAR when nothing was timed."""
    return UNCLEAR if ratio_or_none is None else ratio_or_none.words()
