"""Speed verdicts from adjacent pairs (hmp/tools/timing.py: paired, Ratio) on a scripted machine.

A shared machine's load comes in bursts that multiply every step taken while they last. The clock
here is a parameter of the harness (per_call's), not a mock of it: a step of a configuration advances
it by that configuration's cost times the load at that moment. With the two steps of a pair adjacent,
a burst over both multiplies both and cancels in the pair's ratio; a burst that starts or ends inside
a pair spoils that one pair, which the middle half leaves out. The verdict must be the true one, and
the same with more pairs. No wall-clock time is read or asserted.
"""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmp.tools import host, speed, timing
from hmp.tools.tune_result import TuneResult


class LoadedMachine:
    """A scripted clock and load: bursts of ``factor`` x load lasting ``span`` seconds of this clock,
    separated by quiet gaps; a run of ``cost`` seconds at load L advances the clock by cost x L (the load
    when the run starts holds for the whole run)."""

    def __init__(self, seed, cost, burst=(3.0, 20.0), span=(8.0, 30.0), gap=(8.0, 30.0)):
        rng = random.Random(seed)
        self.now, self.bursts, at = 0.0, [], rng.uniform(0.0, gap[1])
        while at < 1e5:
            length = rng.uniform(*span)
            self.bursts.append((at, at + length, rng.uniform(*burst)))
            at += length + rng.uniform(*gap)
        self.cost = cost

    def clock(self):
        return self.now

    def load(self):
        return next((f for start, end, f in self.bursts if start <= self.now < end), 1.0)

    def step(self, name):
        self.now += self.cost[name] * self.load()

    def samplers(self):
        return {n: (lambda n=n: timing.per_call(lambda: self.step(n), clock=self.clock)) for n in self.cost}


def verdict(true_ratio, pairs, seed, others=1):
    """The Ratio paired() and timing.ratio give for a configuration costing ``true_ratio`` x fp32's
    (a 1 s fp32 step), on a machine with load bursts drawn from ``seed``."""
    cost = {"fp32": 1.0, "lists": true_ratio, **{f"other{i}": 1.3 for i in range(others - 1)}}
    machine = LoadedMachine(seed, cost)
    return timing.paired(machine.samplers(), "fp32", pairs).ratio("lists")


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from([0.5, 0.82, 0.9, 1.0, 1.01, 1.15, 1.5, 4.7]), st.integers(1, 3))
def test_the_verdict_under_load_bursts_is_the_true_one_and_the_same_with_more_pairs(seed, true, others):
    """0.82x is faster at 10, 20, 40 and 80 pairs, however hard the bursts (3x-20x) hit; 1.0x and
    1.01x (inside the margin) are no measurable difference at every count; never the other way round."""
    expected = "faster" if true < 1 - timing.MARGIN else "slower" if true > 1 + timing.MARGIN else speed.UNCLEAR
    said = {n: verdict(true, n, seed, others) for n in (10, 20, 40, 80)}
    assert {speed.direction(r) for r in said.values()} == {expected}
    for r in said.values():
        if expected != speed.UNCLEAR:  # the size said is the true one: the bursts cancelled
            assert r.median == pytest.approx(true, rel=1e-9)


def test_a_burst_over_both_steps_of_every_pair_cancels_exactly():
    machine = LoadedMachine(0, {"fp32": 1.0, "lists": 0.82}, span=(1e6, 1e6), gap=(0.0, 0.0))
    r = timing.paired(machine.samplers(), "fp32", 10).ratio("lists")
    assert (r.low, r.median, r.high) == pytest.approx((0.82, 0.82, 0.82)) and r.faster


def test_pairs_that_are_not_adjacent_are_what_made_verdicts_flip():
    """The failure paired() removes, on the same scripted machine: fp32's steps all taken in one block and
    the other's in the next (as far apart as a block, not as a pair) give a ratio the bursts decide."""
    wrong = set()
    for seed in range(20):
        machine = LoadedMachine(seed, {"fp32": 1.0, "lists": 0.82}, span=(4.0, 12.0), gap=(4.0, 12.0))
        step = machine.samplers()
        fp32 = [step["fp32"]() for _ in range(10)]
        lists = [step["lists"]() for _ in range(10)]
        wrong.add(speed.direction(timing.ratio(fp32, lists)))
        assert speed.direction(verdict(0.82, 10, seed)) == "faster"  # adjacent pairs on the same machine
    assert wrong != {"faster"}  # blocks: some seeds say slower or no difference


def test_each_round_takes_the_reference_adjacent_to_every_other_in_alternating_order():
    log = []
    samplers = {n: (lambda n=n: log.append(n) or len(log)) for n in ("fp32", "A", "B", "C")}
    got = timing.paired(samplers, "fp32", rounds=2, warmup=1)
    # warm-up round, then A fp32 B / C fp32 ... alternating: the reference between two others, or beside one
    assert log == ["A", "fp32", "B", "fp32", "C"] + ["B", "fp32", "A", "C", "fp32"] + ["A", "fp32", "B", "fp32", "C"]
    assert got.pairs == {"A": [(7, 8), (12, 11)], "B": [(7, 6), (12, 13)], "C": [(10, 9), (14, 15)]}
    assert got.reference == [7, 10, 12, 14] and got.samples("C") == [9, 15]


def test_halves_that_disagree_are_no_verdict():
    """The middle half of 10 pairs below the margin, but the second half of the run at 1.0x: the run does
    not say the same twice, so no difference is stated, and the sentence says why."""
    r = timing.ratio([1.0] * 10, [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0][::-1])
    assert r.high < 1 - timing.MARGIN and not r.measurable and speed.direction(r) == speed.UNCLEAR
    assert "not the same when repeated" in speed.words(r)


def test_a_difference_inside_the_margin_is_none_and_says_so():
    r = timing.ratio([1.0] * 10, [0.99] * 10)
    assert not r.measurable and "within the 2% margin" in speed.words(r)


def test_the_tune_verdict_from_paired_steps_on_the_loaded_machine():
    """TuneResult judges the pairs it was given as timing does: the verdict line says faster at 0.82x for
    10 and for 40 pairs, and its page states one fp32 step time."""
    lines = []
    for n in (10, 40):
        machine = LoadedMachine(3, {"fp32": 1.0, "starting lists": 0.82, "tuned lists": 0.82})
        got = timing.paired(machine.samplers(), "fp32", n)
        samples = {"fp32": got.reference, **{k: got.samples(k) for k in got.pairs}}
        result = TuneResult(
            {"bf16": [], "fp32": [], "promote": []},
            {"bf16": [], "fp32": [], "promote": []},
            None,
            {},
            {"fp32": 1.0, "starting lists": 1.0, "tuned lists": 1.0},
            {k: sorted(v)[len(v) // 2] for k, v in samples.items()},
            samples=samples,
        )
        result.pairs, result.rounds = got.pairs, n // 2
        assert result.ratio("tuned lists").faster
        lines.append(result.verdict.split("step time: ")[1])
        assert result.fp32_step().count(" ms") == 1
    assert all(line.startswith("0.82x fp32's time") for line in lines)


def test_the_matrix_product_is_timed_in_pairs_on_the_host_given():
    """matmul_ratio takes its samples through host.measure on the host it is given: a clock that advances
    2 s per read makes every pair 1.0x, no measurable difference (no real time is read); the host's
    waits, none here, are what each sample says the machine did."""
    ticks = iter(range(0, 10**6, 2))
    quiet = host.Host(
        clock=lambda: float(next(ticks)), cpu_clock=lambda: 0.0, waits=lambda: 0.0, machine=lambda: (0.0, 1)
    )
    r = timing.matmul_ratio(shape=(4, 4, 4), rounds=6, host=quiet)
    assert r.pairs == 6 and r.median == pytest.approx(1.0) and speed.direction(r) == speed.UNCLEAR
    assert r.load.taken == 6 and r.load.contended == 0 and r.load.waited == 0.0
