"""Step times relative to fp32 (hmp/tools/timing.py): samples built so the
answer is known, not recomputed the way the module computes it. One
statement of noise: a middle half of the pairs' ratios wholly outside the
margin around 1.0, with both halves of the run agreeing, is a measured
difference, said with its size and range; one that covers 1.0 is none, said
with its range too. And the harness every benchmark times
with (per_call, interleaved, Stopwatch): what it calls, in which order, and
what it keeps, on a fake clock where it takes one (no speed is asserted)."""

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hmp.tools import speed, timing

times = st.floats(1e-4, 10.0)
loads = st.floats(0.2, 5.0)  # load from elsewhere slowing both runs of a pair alike


@st.composite
def paired(draw, ratios):
    """fp32 and other samples whose pairs have exactly the given ratios, each pair under its own load."""
    fp32 = draw(st.lists(times, min_size=len(ratios), max_size=len(ratios)))
    load = draw(st.lists(loads, min_size=len(ratios), max_size=len(ratios)))
    return [a * f for a, f in zip(fp32, load)], [a * f * r for a, f, r in zip(fp32, load, ratios)]


def said_range(words):
    """The (low, high) a sentence or cell gives for the middle half."""
    low, high = re.search(r"(\d+\.\d+)x? ?(?:to|-) ?(\d+\.\d+)x?[);]", words).groups()
    return float(low), float(high)


@given(
    st.data(),
    st.floats(0.2, 5.0),
    # no subnormals: the floor's torch build flushes them to zero, which hypothesis refuses to run under
    st.floats(0.0, 0.2, allow_subnormal=False),
    st.lists(st.floats(-1.0, 1.0, allow_subnormal=False), min_size=4, max_size=30),
)
def test_a_ratio_off_one_is_a_number_a_direction_and_its_range(data, centre, width, offsets):
    ratios = [centre * (1 + width * u) for u in offsets]
    lo, hi = centre * (1 - width), centre * (1 + width)
    fp32, other = data.draw(paired(ratios))
    r = timing.ratio(fp32, other)
    assert lo * (1 - 1e-9) <= r.low <= r.median <= r.high <= hi * (1 + 1e-9)
    band = timing.MARGIN
    if hi < 1 - band:  # every pair, so both halves of the run too, beyond the margin
        assert r.faster and speed.direction(r) == "faster" and "x fp32's time" in speed.words(r)
    elif lo > 1 + band:
        assert r.slower and speed.direction(r) == "slower"
    elif 1 - band <= lo and hi <= 1 + band:  # every pair within the margin: none measured
        assert not r.measurable
    if hi < 1 - band or lo > 1 + band:
        assert speed.words(r).startswith(f"{r.median:.2f}x fp32's time") and speed.UNCLEAR not in speed.words(r)
        assert f"of {len(ratios)} pairs" in speed.words(r)
    for text in (speed.words(r), speed.short(r)):  # the range is always said, to the shown precision
        low, high = said_range(text)
        assert low == pytest.approx(r.low, abs=0.006) and high == pytest.approx(r.high, abs=0.006)


@given(st.data(), st.integers(2, 15), st.floats(1.03, 3.0), st.floats(1.5, 4.0))
def test_a_wide_spread_wholly_on_one_side_is_still_a_measured_difference(data, k, base, factor):
    """0.18x-0.37x from a few runs is faster, however wide: said as a measured difference with its range."""
    fp32, other = data.draw(paired([base] * k + [factor * base] * k))
    r = timing.ratio(fp32, other)
    assert r.low > 1 and r.slower and speed.words(r).startswith(f"{r.median:.2f}x fp32's time")
    assert said_range(speed.words(r)) == pytest.approx((r.low, r.high), abs=0.006)


@given(st.data(), st.integers(2, 15), st.floats(0.5, 0.99), st.floats(1.01, 2.0))
def test_as_many_pairs_faster_as_slower_is_no_measurable_difference(data, k, below, above):
    fp32, other = data.draw(paired([below] * k + [above] * k))
    r = timing.ratio(fp32, other)
    assert not r.measurable and speed.direction(r) == speed.UNCLEAR
    assert speed.words(r).startswith(speed.UNCLEAR) and speed.short(r).startswith(speed.UNCLEAR)
    low, high = said_range(speed.words(r))
    assert low <= 1.0 + 0.005 and high >= 1.0 - 0.005  # the range said covers 1


@given(st.data(), st.lists(st.floats(0.1, 0.5), min_size=1, max_size=2))
def test_too_few_pairs_is_no_measurable_difference(data, ratios):
    fp32, other = data.draw(paired(ratios))
    words = speed.words(timing.ratio(fp32, other))
    assert words.startswith(speed.UNCLEAR) and "too few to tell" in words


def test_no_pair_or_no_fp32_time_is_none():
    assert timing.ratio([], [1.0]) is None and timing.ratio([0.0, 1.0], [1.0, 1.0]) is None
    assert speed.words(None).startswith(speed.UNCLEAR)


def test_the_words_for_a_known_ratio():
    r = timing.ratio([1.0] * 5, [0.5, 0.5, 0.5, 0.5, 0.5])
    assert speed.words(r) == "0.50x fp32's time (middle half of 5 pairs: 0.50x to 0.50x)"
    assert speed.short(r) == "0.50x (0.50-0.50)"
    wide = timing.ratio([1.0] * 4, [0.18, 0.2, 0.35, 0.37])
    assert wide.faster and "fp32's time" in speed.words(wide) and speed.UNCLEAR not in speed.words(wide)


@given(st.integers(1, 40), st.data())
def test_the_chance_of_as_many_faster_pairs_is_the_binomial_tail(n, data):
    """The sign test against its definition: with no difference each pair is below 1 with probability
    1/2, so k or more of n below 1 has probability sum C(n, j) / 2**n over j >= k."""
    k = data.draw(st.integers(0, n))
    ratios = [0.9] * k + [1.1] * (n - k)
    r = timing.ratio([1.0] * n, ratios)
    tail = sum(math.comb(n, j) for j in range(k, n + 1)) / 2**n
    assert r.below == k and r.chance() == pytest.approx(tail)
    assert r.surely_faster == (r.faster and tail < timing.SURE)


def test_what_tune_asks_of_a_gain_in_ten_pairs():
    """Nine of ten pairs faster is beyond chance; eight (the middle half still below 1) is not."""
    nine = timing.ratio([1.0] * 10, [0.9] * 9 + [1.1])
    eight = timing.ratio([1.0] * 10, [0.9] * 4 + [1.1] + [0.9] * 4 + [1.1])  # each half of the run faster too
    assert nine.surely_faster and eight.faster and not eight.surely_faster
    few = timing.ratio([1.0] * 5, [0.5] * 5)  # all five faster: 1 in 32 by chance
    assert few.faster and not few.surely_faster


# -- the harness the benchmarks time with: what it calls, in which order, and what it keeps


class FakeClock:
    """A clock that moves only when told, logging each read into ``log``."""

    def __init__(self, log):
        self.now, self.log = 100.0, log

    def __call__(self):
        self.log.append("clock")
        return self.now


def test_per_call_reads_the_clock_between_the_syncs_and_divides_by_the_calls():
    log = []
    clock = FakeClock(log)

    def fn():
        log.append("call")
        clock.now += 2.0

    took = timing.per_call(fn, calls=5, sync=lambda: log.append("sync"), clock=clock)
    assert took == pytest.approx(2.0)
    # queued work is drained before the clock starts, and the calls' own before it stops
    assert log == ["sync", "clock"] + ["call"] * 5 + ["sync", "clock"]


def test_per_call_without_a_sync_calls_fn_as_often_as_asked():
    calls = []
    took = timing.per_call(lambda: calls.append(1), calls=7)
    assert len(calls) == 7 and took >= 0.0  # no hidden warm-up call


def test_per_call_wall_and_thread_reads_both_clocks_around_the_same_calls():
    log = []
    wall, thread = FakeClock(log), FakeClock(log)

    def fn():
        log.append("call")
        wall.now += 3.0
        thread.now += 1.0  # a third of the wall time spent on a core

    assert timing.per_call_wall_and_thread(fn, calls=4, wall=wall, thread=thread) == pytest.approx((3.0, 1.0))
    assert log == ["clock", "clock"] + ["call"] * 4 + ["clock", "clock"]


def test_a_sleep_is_wall_time_and_not_the_threads():
    import time

    took_wall, took_thread = timing.per_call_wall_and_thread(lambda: time.sleep(0.01), calls=3)
    assert took_wall >= 0.01 and took_thread < 0.005


def test_per_call_of_a_sleep_is_at_least_the_sleep():
    import time

    assert timing.per_call(lambda: time.sleep(0.002), calls=3) >= 0.002


def test_per_call_leaves_the_collector_as_the_caller_has_it():
    import gc

    seen = []
    timing.per_call(lambda: seen.append(gc.isenabled()))
    with timing.collector_paused():
        timing.per_call(lambda: seen.append(gc.isenabled()))
    assert seen == [gc.isenabled(), False]


def test_rotated_starts_each_round_one_further():
    assert [timing.rotated("ABC", i) for i in range(4)] == [list("ABC"), list("BCA"), list("CAB"), list("ABC")]
    assert timing.rotated([], 3) == []


def _recording(names, log):
    """Samplers that log their name and return how many samples were taken so far."""
    return {n: (lambda n=n: log.append(n) or len(log)) for n in names}


def test_interleaved_rotates_the_order_round_by_round():
    log = []
    samples = timing.interleaved(_recording("ABC", log), rounds=4)
    assert "".join(log) == "ABC" + "BCA" + "CAB" + "ABC"
    assert list(samples) == ["A", "B", "C"]  # in the given order, whatever ran first
    assert samples == {"A": [1, 6, 8, 10], "B": [2, 4, 9, 11], "C": [3, 5, 7, 12]}


def test_interleaved_without_rotation_keeps_the_given_order():
    log = []
    samples = timing.interleaved(_recording("ABC", log), rounds=3, rotate=False)
    assert "".join(log) == "ABC" * 3 and all(len(v) == 3 for v in samples.values())


def test_warm_up_rounds_run_in_the_given_order_and_are_not_kept():
    log = []
    samples = timing.interleaved(_recording("AB", log), rounds=2, warmup=2)
    # two untimed rounds, then the timed rounds' rotation from its start
    assert "".join(log) == "ABAB" + "AB" + "BA"
    assert samples == {"A": [5, 8], "B": [6, 7]}


def test_after_round_sees_each_timed_round_once_it_is_complete():
    seen = []
    timing.interleaved(
        _recording("AB", []), rounds=3, warmup=1, after_round=lambda i, s: seen.append((i, len(s["A"]), len(s["B"])))
    )
    assert seen == [(0, 1, 1), (1, 2, 2), (2, 3, 3)]


def test_a_stopwatch_says_the_seconds_since_it_started():
    log = []
    clock = FakeClock(log)
    watch = timing.Stopwatch(clock)
    clock.now += 12.5
    assert watch.elapsed == pytest.approx(12.5)
    clock.now += 1.0
    assert watch.elapsed == pytest.approx(13.5)  # it keeps running


def test_a_stopwatch_on_the_real_clock_counts_a_sleep():
    import time

    watch = timing.Stopwatch()
    time.sleep(0.002)
    assert watch.elapsed >= 0.002


def test_the_spread_of_raw_samples():
    assert timing.quartiles([3.0]) == (3.0, 3.0)
    low, high = timing.quartiles([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    assert (low, high) == (2.0, 6.0)
    assert timing.iqr_rel([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]) == pytest.approx(4.0 / 4.0)
    assert math.isnan(timing.iqr_rel([1.0, 2.0, 3.0]))  # too few for quartiles worth the name
    assert timing.iqr_rel([5.0] * 6) == 0.0
