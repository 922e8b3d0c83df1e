"""Speed verdicts on a scripted busy machine (hmp/tools/host.py, timing.py, speed.py).

What was seen on a 2-core machine at load 2-5 (a demo said 0.22x, then 1.16x, both "measured"),
replayed with a scripted clock and scripted counters: the run-queue wait the kernel reports per
thread, the steal a hypervisor takes, the CPU time. The readers are host.Host's parameters, which
the code under test reads as it reads /proc on a real machine; nothing of it is mocked. Bursts, a
hog on both cores, a slow first half: no verdict is reversed, and no run other programs delayed
yields a "measured" claim. No wall-clock time is read or asserted.
"""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmp.tools import host, speed, timing
from hmp.tools.tune_result import TuneResult

MEASURED = ("faster", "slower")


class Machine:
    """A scripted machine running steps of configurations that cost ``cost[name]`` seconds alone.

    ``busy(t)``: how many times longer a step started at ``t`` takes because other programs hold its
    CPUs (the extra time is this process's threads waiting for a CPU, which the kernel counts);
    ``slow(t, name)``: a slowdown nothing counts (the same CPUs, slower: a neighbour on the memory
    bus, a clock stepping down); ``steal(t)``: the share of a step a hypervisor takes on top."""

    def __init__(self, cost, busy=lambda t: 1.0, slow=lambda t, name: 1.0, steal=lambda t: 0.0, waits=True):
        self.cost, self.busy, self.slow, self.steal_at = cost, busy, slow, steal
        self.now = self.cpu = self.waited = self.stolen = 0.0
        self.runnable = 1
        self.reports_waits = waits

    def host(self):
        return host.Host(
            clock=lambda: self.now,
            cpu_clock=lambda: self.cpu,
            waits=lambda: self.waited if self.reports_waits else None,
            machine=lambda: (self.stolen, self.runnable),
            cpus=lambda: 1,
            threads=lambda: 1,
        )

    def run(self, name):
        alone = self.cost[name] * self.slow(self.now, name)
        factor, stolen = self.busy(self.now), alone * self.steal_at(self.now)
        self.runnable = 1 + (factor > 1.0) * 2  # a hog per core beside this process's thread
        self.cpu += alone
        self.waited += alone * (factor - 1.0)
        self.stolen += stolen
        self.now += alone * factor + stolen

    def samplers(self, names=None):
        on = self.host()
        return {n: (lambda n=n: host.measure(lambda: self.run(n), host=on)) for n in (names or self.cost)}


def bursts(seed, factor=(2.0, 20.0), span=(8.0, 30.0), gap=(8.0, 30.0)):
    """Load in bursts: ``factor`` times longer while one lasts (``span`` seconds), quiet ``gap``s between."""
    rng, found, at = random.Random(seed), [], 0.0
    at = rng.uniform(0.0, gap[1])
    while at < 1e5:
        length = rng.uniform(*span)
        found.append((at, at + length, rng.uniform(*factor)))
        at += length + rng.uniform(*gap)
    return lambda t: next((f for start, end, f in found if start <= t < end), 1.0)


def verdict(machine, pairs, control=False):
    """The Ratio of "lists" to "fp32" from ``pairs`` adjacent pairs (and the control: "lists" timed twice)."""
    names = ["fp32", "lists", "lists again"] if control else ["fp32", "lists"]
    got = timing.paired(machine.samplers(names), "fp32", pairs)
    return got.ratio("lists", control=got.control("lists", "lists again") if control else None)


def expected(true):
    return "faster" if true < 1 - timing.MARGIN else "slower" if true > 1 + timing.MARGIN else speed.UNCLEAR


def opposite(a, b):
    return {a, b} == set(MEASURED)


TRUE = st.sampled_from([0.5, 0.82, 0.9, 1.0, 1.01, 1.15, 1.5, 4.7])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), TRUE, st.sampled_from([10, 20, 40]), st.booleans())
def test_bursts_that_delay_the_runs_never_reverse_a_verdict(seed, true, pairs, control):
    """Bursts of 2x-20x that other programs make: a pair they touch is left out, the rest say the true
    verdict; where most pairs were touched, "could not measure here", never the opposite direction."""
    machine = Machine({"fp32": 1.0, "lists": true, "lists again": true}, busy=bursts(seed))
    r = verdict(machine, pairs, control)
    said = speed.direction(r)
    assert said in (expected(true), speed.NOT_HERE), (said, speed.words(r))
    if said in MEASURED:
        assert r.median == pytest.approx(true, rel=1e-9)  # from the pairs no burst touched
        assert r.load.contended * 2 <= r.load.taken and r.pairs >= timing.MIN_PAIRS
    if said == speed.NOT_HERE:
        assert speed.words(r).startswith(speed.NOT_HERE) and "other programs" in speed.words(r)


@pytest.mark.parametrize("true", [0.5, 0.82, 1.0, 1.5])
def test_a_hog_on_both_cores_gives_no_measured_claim(true):
    """Two `while 1: pass` beside the run, the whole time: every step waits for a CPU as long as it runs;
    the verdict says it could not measure here, why, and how to get a measurement."""
    machine = Machine({"fp32": 1.0, "lists": true, "lists again": true}, busy=lambda t: 2.0)
    for control in (False, True):
        r = verdict(machine, 20, control)
        assert speed.direction(r) == speed.NOT_HERE and not r.measurable and r.busy
        words = speed.words(r, longer="--rounds 20")
        assert words.startswith(f"{speed.NOT_HERE} (in 20 of 20 pairs a run lost more than 2% of its time")
        # each step took twice its time: half of it waiting for a CPU
        assert (
            "waited for a CPU 50% of the runs' time, on average" in words
            and "idle machine" in words
            and "--rounds 20" in words
        )
        assert speed.short(r) == "not measured: machine busy" and speed.cell(r) == "not measured"
        said = speed.speed_sentence(r, "a step")
        assert said.startswith(f"Speed: {speed.NOT_HERE} how a step compares with fp32: in 20 of 20 pairs")


@settings(max_examples=30, deadline=None)
@given(TRUE, st.floats(1.2, 6.0), st.floats(0.3, 0.7), st.booleans())
def test_a_slow_first_half_never_reverses_a_verdict(true, factor, share, control):
    """The first part of the run (``share`` of it) ``factor`` times slower: where other programs made it (the
    threads' waits count it) those pairs are left out, and the rest say the true verdict or, where most
    were left out, that it could not measure; where nothing counts it (the same CPUs, slower) it falls on
    both runs of each pair and cancels. Never the opposite verdict, never a wrong size."""
    end = 20 * (1.0 + true) * share * factor  # the first ``share`` of 20 rounds, at the slower speed
    for machine in (
        Machine({"fp32": 1.0, "lists": true, "lists again": true}, busy=lambda t: factor if t < end else 1.0),
        Machine({"fp32": 1.0, "lists": true, "lists again": true}, slow=lambda t, n: factor if t < end else 1.0),
    ):
        r = verdict(machine, 20, control)
        said = speed.direction(r)
        assert said in (expected(true), speed.NOT_HERE) and not opposite(said, expected(true)), speed.words(r)
        if said in MEASURED:
            assert abs(r.median - true) <= (factor - 1) * true  # at most the one pair a change falls inside


def test_a_slowdown_on_one_arm_is_caught_by_the_control():
    """Something nothing counts slows every other step of the same lists: the two arms disagree, and no
    verdict is given though the pairs alone would have said "faster"."""
    every_other = {"n": 0}

    def slow(t, name):
        every_other["n"] += name == "lists again"
        return 1.4 if name == "lists again" else 1.0

    machine = Machine({"fp32": 1.0, "lists": 0.82, "lists again": 0.82}, slow=slow)
    alone = verdict(Machine({"fp32": 1.0, "lists": 0.82}), 10)
    r = verdict(machine, 10, control=True)
    assert alone.faster and not r.measurable and not r.control_agrees
    assert speed.direction(r) == speed.NOT_HERE
    assert "the control disagreed, the same lists timed twice: 1.40x" in speed.words(r)
    assert speed.short(r) == "not measured: control disagreed"


def test_an_agreeing_control_is_said_with_its_spread():
    r = verdict(Machine({"fp32": 1.0, "lists": 0.82, "lists again": 0.82}), 10, control=True)
    assert r.faster and speed.words(r) == (
        "0.82x fp32's time (middle half of 10 pairs: 0.82x to 0.82x; control: the same lists timed twice: 1.00x "
        "(middle half of 10 pairs: 1.00x to 1.00x))"
    )


def test_steal_counts_as_time_other_programs_took():
    """A hypervisor that takes 10% of every run: the guest's waits say nothing, its steal does (over the runs
    together: the kernel counts it in 10 ms ticks, too coarse for one short run)."""
    r = verdict(Machine({"fp32": 1.0, "lists": 0.5}, steal=lambda t: 0.1), 10)
    assert r.busy and speed.direction(r) == speed.NOT_HERE and "the hypervisor took" in speed.words(r)


def test_a_host_that_does_not_report_waits_is_judged_by_its_runnable_tasks():
    quiet = verdict(Machine({"fp32": 1.0, "lists": 0.5}, waits=False), 10)
    assert quiet.faster and "does not report how long its threads wait" in speed.load_words(quiet.load)
    hog = verdict(Machine({"fp32": 1.0, "lists": 0.5}, busy=lambda t: 2.0, waits=False), 10)
    assert hog.busy and speed.words(hog).startswith(f"{speed.NOT_HERE} (this host does not say whether")


def test_a_sample_is_what_the_counters_moved_by():
    machine = Machine({"a": 2.0}, busy=lambda t: 1.5, steal=lambda t: 0.25)
    sample = host.measure(lambda: machine.run("a"), host=machine.host())
    assert sample.seconds == sample.wall == pytest.approx(3.5)  # 2 s of work, 1 s waiting, 0.5 s stolen
    assert (sample.waited, sample.stolen, sample.cpu) == pytest.approx((1.0, 0.5, 2.0))
    assert sample.contention() == pytest.approx(1.0 / 3.5) and sample.cpus == 1  # steal: judged over all runs
    three = host.measure(lambda: machine.run("a"), host=machine.host(), calls=3)
    assert three.seconds == pytest.approx(3.5) and three.waited == pytest.approx(1.0)  # per call


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**6), TRUE)
def test_two_runs_on_a_busy_machine_never_give_opposite_measured_verdicts(seed_a, seed_b, true):
    """The demo's failure, run twice on differently busy stretches of the same machine: each says the
    true verdict, no difference, or that it could not measure; never one faster and one slower."""
    said = []
    for seed in (seed_a, seed_b):
        machine = Machine({"fp32": 1.0, "lists": true}, busy=bursts(seed, span=(1.0, 6.0), gap=(0.5, 4.0)))
        said.append(speed.direction(verdict(machine, 20)))
    assert not opposite(*said) and set(said) <= {expected(true), speed.UNCLEAR, speed.NOT_HERE}


def test_the_same_lists_get_one_verdict_on_a_tune_page():
    """Tune's starting and tuned lists the same: one measurement, one verdict, the same cell in both rows."""
    machine = Machine({"fp32": 1.0, "starting lists": 0.82, "again": 0.82}, busy=bursts(5))
    got = timing.paired(machine.samplers(), "fp32", 10)
    empty = {"bf16": [], "fp32": [], "promote": []}
    result = TuneResult(empty, empty, None, {}, {"fp32": 1.0, "starting lists": 1.0, "tuned lists": 1.0}, {})
    result.pairs = {"starting lists": got.pairs["starting lists"]}
    result.same_as, result.control = {"tuned lists": "starting lists"}, got.control("starting lists", "again")
    assert result.time_cell("tuned lists") == result.time_cell("starting lists")
    assert result.ratio("tuned lists") == result.ratio("starting lists")


def test_a_profile_says_how_many_of_its_runs_other_programs_delayed():
    machine = Machine({"a": 1.0}, busy=lambda t: 2.0 if t < 3.5 else 1.0)
    on = machine.host()
    samples = [host.measure(lambda: machine.run("a"), host=on) for _ in range(5)]
    busy = sum((s.contention() or 0.0) > timing.MARGIN for s in samples)
    said = speed.profile_noise([(0.001, 0.0001)] * 5, timing.load_of([(s,) for s in samples], busy))
    assert busy == 2 and "; 2 of 5 runs lost more than 2% of their time to other programs" in said
    assert "this process's threads waited for a CPU" in said
