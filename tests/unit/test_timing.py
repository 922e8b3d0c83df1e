"""Step times relative to fp32 (hmp/tools/timing.py): samples built so the
answer is known, not recomputed the way the module computes it."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hmp.tools import timing

times = st.floats(1e-4, 10.0)
loads = st.floats(0.2, 5.0)  # load from elsewhere slowing both runs of a pair alike


@st.composite
def paired(draw, ratios):
    """fp32 and other samples whose pairs have exactly the given ratios, each pair under its own load."""
    fp32 = draw(st.lists(times, min_size=len(ratios), max_size=len(ratios)))
    load = draw(st.lists(loads, min_size=len(ratios), max_size=len(ratios)))
    return [a * f for a, f in zip(fp32, load)], [a * f * r for a, f, r in zip(fp32, load, ratios)]


@given(
    st.data(),
    st.floats(0.2, 5.0),
    # no subnormals: the floor's torch build flushes them to zero, which hypothesis refuses to run under
    st.floats(0.0, 0.2, allow_subnormal=False),
    st.lists(st.floats(-1.0, 1.0, allow_subnormal=False), min_size=4, max_size=30),
)
def test_a_tight_ratio_off_one_is_a_number_and_a_direction(data, centre, width, offsets):
    ratios = [centre * (1 + width * u) for u in offsets]
    lo, hi = centre * (1 - width), centre * (1 + width)
    fp32, other = data.draw(paired(ratios))
    r = timing.ratio(fp32, other)
    assert lo * (1 - 1e-9) <= r.low <= r.median <= r.high <= hi * (1 + 1e-9)
    if hi < 1:
        assert r.faster and r.direction() == "faster" and "x fp32's time" in r.words()
    elif lo > 1:
        assert r.slower and r.direction() == "slower"
    if hi < 1 or lo > 1:
        assert f"{r.median:.2f}x" in r.words() and timing.UNCLEAR not in r.words()


@given(st.data(), st.integers(2, 15), st.floats(0.5, 0.99), st.floats(1.01, 2.0))
def test_as_many_pairs_faster_as_slower_is_no_measurable_difference(data, k, below, above):
    fp32, other = data.draw(paired([below] * k + [above] * k))
    r = timing.ratio(fp32, other)
    assert not r.measurable and r.words() == timing.UNCLEAR and r.direction() == timing.UNCLEAR


@given(st.data(), st.integers(2, 15), st.floats(1.01, 3.0))
def test_a_spread_wider_than_a_quarter_is_no_measurable_difference(data, k, base):
    # half the pairs at base, half at 3x base: all slower, but the middle half is +-50% of the median
    fp32, other = data.draw(paired([base] * k + [3 * base] * k))
    r = timing.ratio(fp32, other)
    assert r.low > 1 and r.spread > timing.NOISE and r.words() == timing.UNCLEAR


@given(st.data(), st.lists(st.floats(0.1, 0.5), min_size=1, max_size=2))
def test_too_few_pairs_is_no_measurable_difference(data, ratios):
    fp32, other = data.draw(paired(ratios))
    assert timing.ratio(fp32, other).words() == timing.UNCLEAR


def test_no_pair_or_no_fp32_time_is_none():
    assert timing.ratio([], [1.0]) is None and timing.ratio([0.0, 1.0], [1.0, 1.0]) is None
    assert timing.words(None) == timing.UNCLEAR


def test_the_words_for_a_known_ratio():
    r = timing.ratio([1.0] * 5, [0.5, 0.5, 0.5, 0.5, 0.5])
    assert r.words() == "0.50x fp32's time (+-0%)" and r.short() == "0.50x +-0%"
    assert r.spread == pytest.approx(0.0)
