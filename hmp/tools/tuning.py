"""hmp.tune: lists that are fast and safe for this model.

1. audit the current lists; flagged ops move to the FP32 list, except where
   an op's error is confined to one module class: that class is proposed
   for the FP32 list instead (checked by a run with the op cast everywhere
   else), and the op keeps its list; a module class whose own code makes
   too much error, still with the flagged ops moved, is proposed too;
2. find the ops the step runs that still compute in fp32 and take a share
   of its op time (op_costs.py: warmed up, medians of repeated runs), except
   those whose input the model's author computes in float32 on purpose;
   try each alone in bf16, and keep one only when its own error and the
   error it passes on to the loss stay under the bounds AND a step with it
   in bf16 is measurably faster than without (step times in adjacent
   pairs, timing.py: the middle half of the pairs' ratios below the margin,
   both halves of the run agreeing), so no op is moved on timing noise;
3. validate: train a few steps from the same state in fp32, with the current
   lists and with the candidate, each step's loss recorded (the verdict's
   interval, TuneResult.loss_gaps); if the candidate's loss strays from
   fp32's, drop the additions and module proposals; time a step of each,
   each in adjacent pairs with fp32's, and a bf16 matrix product against
   fp32's (what the page says of this machine's arithmetic).

Every phase counts in runs of the user's step (progress.StepRuns), shown on
stderr or handed to ``progress``.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Iterable

from hmp.binding import kinds
from hmp.binding.kinds import FP32, LOWER, PROMOTE
from hmp.binding.resolve import Resolver
from hmp.core.hints import Step
from hmp.driver.conversion import applied
from hmp.tools import host, op_costs, speed, timing
from hmp.tools.auditing import audit_with, in_force_or_default, kind_of, made_in, run_step
from hmp.tools.guard import StateGuard
from hmp.tools.loss import StepDoesNotTrain, check_trains, step_loss  # noqa: F401 (tune_cli's)
from hmp.tools.output_errors import by_op, compare, pairs, worst
from hmp.tools.progress import StepRuns
from hmp.tools.record import within
from hmp.tools.sentences import bounds_broken
from hmp.tools.target import user_name
from hmp.tools.tune_result import TuneResult


def _empty_lists():
    """Every list kind to an empty set: a conversion's lists before its ops are put in."""
    return {k: set() for k in kinds.KINDS}


def _as_sets(lists):
    return {k: set(v) for k, v in lists.items()}


def _as_float(value):
    return float(step_loss(value, "hmp.tune").detach().double().mean())


def _train(fn, args, kwargs, guard, steps, conversion, losses=None):
    """fn's value after ``steps`` calls from the guarded state under
    ``conversion`` (None: plain torch); with a list for ``losses``, each
    step's loss appended to it. Untimed: step times are paired()'s."""
    value = None
    with guard.running(), applied(conversion):
        for _ in range(steps):
            value = fn(*args, **kwargs)
            if losses is not None:
                losses.append(_as_float(value))
    return _as_float(value)


def _step_time(fn, args, kwargs, guard, conversion, device="cpu"):
    """One step's time under ``conversion`` (None: plain torch) from the guarded state, after one
    untimed step (the first after convert pays its first calls): one sample of paired(), a host.Sample
    with what the machine did while it ran."""
    with guard.running(), applied(conversion):
        fn(*args, **kwargs)
        return host.measure(lambda: fn(*args, **kwargs), device)


PAIR_STEPS = 2  # steps a configuration runs per sample: one untimed, one timed
CONTROL = "starting lists, again"  # the control arm: the starting lists timed a second time


def _paired_times(fn, args, kwargs, guard, configs, pairs, reference):
    """Step times of every configuration in ``pairs`` adjacent pairs with ``reference``'s
    (timing.paired: a pair's two steps run one after the other, in alternating order, so load on this
    machine that lasts a pair falls on both), with Python's garbage collector paused."""
    device = host.device_of(guard.modules)
    samplers = {
        name: (lambda c=conversion: _step_time(fn, args, kwargs, guard, c, device))
        for name, conversion in configs.items()
    }
    with timing.collector_paused():
        return timing.paired(samplers, reference, pairs)


def confined_to(report, op, roots):
    """The module class in whose instances alone ``op``'s own error exceeds
    the audit's threshold, when the op also runs elsewhere and the class is
    not that of one of the ``roots`` (a whole model); else None."""
    row = next(r for r in report.rows if r["op"] == op)
    types = {r["path"]: r["type"] for r in report.modules}
    over = {types.get(m) for m, error in row["own_by_module"].items() if error > report.threshold}
    if len(over) != 1 or None in over:
        return None
    cls = over.pop()
    if any(isinstance(r, cls) for r in roots):
        return None  # the whole model under FP32: moving the op is the narrower change
    inside = [r["path"] for r in report.modules if issubclass(r["type"], cls)]
    elsewhere = [m for m in row["own_by_module"] if m is None or not any(within(m, p) for p in inside)]
    return cls if elsewhere else None


COST_RUNS = 3  # timed runs of a step whose calls' medians give each op's cost (op_costs.measure)


class _Tuner:
    """One tune() run, a method per phase; the state they share is on self."""

    def __init__(self, step_fn, args, kwargs, bounds, runs, override_fp32=False):
        self.fn, self.args, self.kwargs, self.runs = step_fn, args, kwargs, runs
        self.threshold, self.loss_threshold, self.tolerance, self.min_share, self.steps, self.rounds = bounds
        self.override_fp32 = override_fp32
        self.pairs = 2 * self.rounds  # adjacent pairs per comparison: with the default 5 rounds, 10
        self.start = in_force_or_default()
        self.start_lists = _as_sets(self.start.lists)

    def under(self, lists, fp32_modules=()):
        """The starting conversion with ``lists`` and ``fp32_modules`` added to its FP32 module entries."""
        fp32 = tuple(dict.fromkeys(self.start.modules[FP32] + tuple(fp32_modules)))
        return self.start._replace(lists=lists, modules={**self.start.modules, FP32: fp32})

    def run_step(self, conversion, **options):
        return run_step(self.run, self.args, self.kwargs, self.guard, conversion, **options)

    def train(self, conversion, steps=None, losses=None):
        return _train(self.run, self.args, self.kwargs, self.guard, steps or self.steps, conversion, losses)

    def __call__(self, state):
        self.guard = StateGuard("hmp.tune", state, self.args, self.kwargs, self.fn)
        self.run = self.runs.counted(self.fn)  # every run of the step, counted for progress
        self.candidates = self.confined = self.classes = None  # not known before the audit and the costs
        try:
            self.ahead("trains")
            self.runs.expect(3, "checking that the step trains")
            check_trains(self.run, self.args, self.kwargs, self.guard)
            self.ahead("audit")
            self.audit()
            self.ahead("costs")
            self.find_candidates()
            self.trials = {}
            for i, op in enumerate(self.candidates):
                self.ahead("trials", len(self.candidates) - i - 1)
                self.trials[op] = self.try_in_bf16(op)
            self.ahead("proposals")
            self.proposals = {op: self.try_class_instead(op, cls) for op, cls in self.confined.items()}
            self.module_proposals = {}
            self.ahead("classes")
            for row in self.classes:
                self.try_class(row)
            self.ahead("validation")
            self.validate()
            self.ahead("timing")
            self.time()
        finally:
            self.guard.restore()
        return self.result()

    def ahead(self, phase, trials_left=None):
        """Tell progress the runs of the phases after ``phase``, as far as known now: a phase's runs are
        counted before it starts, so the time left counts every phase left, not the current one alone.
        Where a count is not known yet (the ops the audit casts, the candidates), its least."""
        timing_pairs = self.pairs * PAIR_STEPS
        trial = 1 + 2 * timing_pairs  # an op tried alone, then timed with and without it (at most)
        runs = {
            "trains": 3,
            "audit": 2
            + 3 * (op_costs.TIMED_PAIRS + 1),  # a step in fp32 and under the lists; the ops timed (three arms)
            "costs": 2 + COST_RUNS,
            "trials": trial * (len(self.candidates) if trials_left is None else trials_left) if self.candidates else 0,
            "proposals": len(self.confined or ()),
            "classes": 2 * len(self.classes or ()),
            "validation": 3 * self.steps,
            "timing": 4 * timing_pairs,  # fp32, the starting lists twice, the tuned lists
        }
        phases = list(runs)
        left = sum(runs[p] for p in phases[phases.index(phase) + 1 :])
        self.runs.later(left + (runs["trials"] if phase == "trials" else 0))  # the trials after this one

    def audit(self):
        """Audit the starting lists; the flagged ops move to FP32 (self.lists)."""
        self.report = audit_with(
            self.guard, self.run, self.args, self.kwargs, self.threshold, self.loss_threshold, self.runs
        )
        self.lists = _as_sets(self.start_lists)
        for op in self.report.flagged:
            for k in kinds.KINDS:
                self.lists[k].discard(op)
            self.lists[FP32].add(op)
        self.confined = {
            op: cls for op in self.report.flagged if (cls := confined_to(self.report, op, self.guard.modules))
        }

    def find_candidates(self):
        """What still computes in fp32 under the lists so far and takes at
        least ``min_share`` of the step's op time (op_costs.measure: warmed
        up, each call's median over COST_RUNS runs), leaving out the ops
        whose input the model's author computes in float32 (``authored``;
        tried too with ``override_fp32``); and the fp32 reference run that
        records their outputs (and the confined ops') uncast."""
        conversion = self.under(self.lists)

        def one_step():
            with self.guard.running(), applied(conversion):
                self.run(*self.args, **self.kwargs)

        self.runs.expect(1 + COST_RUNS, "measuring what each op costs in fp32")
        costs = op_costs.measure(one_step, self.guard.modules, runs=COST_RUNS)
        resolver = Resolver()
        self.seconds, self.cost_step = costs.seconds, costs.step_seconds
        large = [
            op
            for op in costs.seconds
            if costs.share(op) >= self.min_share
            and op not in self.lists[LOWER]
            and op not in self.report.flagged
            and resolver.exists(op)
        ]
        self.authored = [] if self.override_fp32 else sorted(op for op in large if op in costs.authored)
        self.candidates = [op for op in large if op not in self.authored]
        audited = {**_empty_lists(), LOWER: set(self.candidates) | set(self.confined)}
        self.runs.expect(1, "a reference step in fp32")
        self.ref_final, self.ref = self.run_step(
            self.under(audited), passthrough=True, keep_outputs=True, module_outputs=True
        )
        self.ref_outputs = by_op(self.ref.outputs)
        self.classes = [row for row in self.report.module_classes if row["made_max_rel"] > self.threshold]

    def alone(self, op, only, fp32_modules=()):
        """Errors of ``op`` cast alone (its list in ``only``), against the reference."""
        own_final, own = self.run_step(self.under(only, fp32_modules), keep_outputs=True, restore_dtype=True)
        loss_error, _, nonfinite = compare(self.ref_final, own_final)
        own_max_rel, _, own_nonfinite = worst(pairs(self.ref_outputs, by_op(own.outputs), op))
        stats = own.stats.get(op)
        ok = (
            stats is not None
            and stats.casts > 0
            and own_max_rel <= self.threshold
            and loss_error <= self.loss_threshold
            and not (nonfinite or own_nonfinite)
        )
        return {
            "own_max_rel": own_max_rel,
            "loss_error": loss_error,
            "nonfinite": nonfinite + own_nonfinite,
            "accepted": ok,
        }

    def try_in_bf16(self, op):
        """``op`` alone in bf16: its errors against the reference; within the bounds, a step's time
        with it in bf16 against without (interleaved); kept only when that step is measurably faster."""
        self.runs.expect(1, f"trying {op} in bf16")
        trial = {
            "was": kind_of(op, self.lists),
            "seconds": self.seconds[op],
            # the whole step of the same runs (op_costs.measure): the op's time is a part of it, not of a
            # step timed elsewhere or in another configuration
            "step_seconds": self.cost_step,
            **self.alone(op, {**_empty_lists(), LOWER: {op}}),
            "time_ratio": None,
        }
        if trial["accepted"]:
            ratio = self.step_ratio_with(op)
            # what the op can save at most: its whole fp32 time, as a share of the step it was measured in
            trial["time_ratio"] = ratio
            trial["ceiling"] = self.seconds[op] / self.cost_step if self.cost_step else 0.0
            trial["accepted"] = ratio is not None and ratio.surely_faster and 1 - ratio.high <= trial["ceiling"]
        trial["outcome"], trial["why"] = trial_outcome(trial, self.threshold, self.loss_threshold)
        return trial

    def step_ratio_with(self, op):
        """A step's time with ``op`` added to the BF16 list, relative to the lists so far
        (timing.Ratio): 2 x ``rounds`` adjacent pairs."""
        lists = {k: v - {op} for k, v in self.lists.items()}
        lists[LOWER].add(op)
        configs = {"without": self.under(self.lists), "with": self.under(lists)}
        self.runs.expect(len(configs) * self.pairs * PAIR_STEPS, f"timing a step with {op} in bf16")
        got = _paired_times(self.run, self.args, self.kwargs, self.guard, configs, self.pairs, "without")
        return got.ratio("with")

    def try_class_instead(self, op, cls):
        """The flagged ``op`` cast where its starting list says, with ``cls`` in FP32."""
        only = {k: ({op} if op in self.start_lists[k] else set()) for k in kinds.KINDS}
        self.runs.expect(1, f"{op} with {cls.__name__} in FP32")
        return {"class": user_name(cls), "type": cls, **self.alone(op, only, [cls])}

    def try_class(self, row):
        """A module class whose own code makes too much error (audit's "error made in it"), measured again
        with the flagged ops moved: proposed for FP32 when it still makes it."""
        cls = row["type"]
        if cls in self.confined.values() or any(isinstance(r, cls) for r in self.guard.modules):
            return
        self.runs.expect(2, f"module class {cls.__name__}")
        made = made_in(self.run, self.args, self.kwargs, self.guard, self.under(self.lists), self.ref, row["paths"])
        made_max_rel = max((m[0] for m in made.values()), default=0.0)
        fp32_final, _ = self.run_step(self.under(self.lists, [cls]))
        loss_error, _, nonfinite = compare(self.ref_final, fp32_final)
        self.module_proposals[row["class"]] = {
            "class": row["class"],
            "type": cls,
            "made_max_rel": made_max_rel,
            "loss_error": loss_error,
            "nonfinite": nonfinite,
            "accepted": made_max_rel > self.threshold and not nonfinite,
        }

    def proposed(self):
        """The lists and FP32 module classes the accepted trials and proposals make."""
        candidate = _as_sets(self.lists)
        for op, t in self.trials.items():
            if t["accepted"]:
                for k in kinds.KINDS:
                    candidate[k].discard(op)
                candidate[LOWER].add(op)
        for op, p in self.proposals.items():
            if p["accepted"]:  # the op keeps its starting list; its class goes to FP32
                for k in kinds.KINDS:
                    candidate[k].discard(op)
                    if op in self.start_lists[k]:
                        candidate[k].add(op)
        everything = list(self.proposals.values()) + list(self.module_proposals.values())
        return candidate, [p["type"] for p in everything if p["accepted"]]

    def validate(self):
        """Train from the same state in fp32, under the starting lists and under the proposal; a proposal
        further from fp32 than both the tolerance and the starting lists is dropped."""
        self.candidate, to_fp32 = self.proposed()
        self.configs = {
            "fp32": None,
            "starting lists": self.under(self.start_lists),
            "tuned lists": self.under(self.candidate, to_fp32),
        }
        self.validation, self.trajectories = {}, {}
        self.runs.expect(len(self.configs) * self.steps, "validation: training in each configuration")
        for name, conversion in self.configs.items():
            self.trajectories[name] = []
            self.validation[name] = self.train(conversion, losses=self.trajectories[name])
        if not self.acceptable("tuned lists") and (self.candidate != self.lists or to_fp32):
            everything = [*self.trials.values(), *self.proposals.values(), *self.module_proposals.values()]
            for t in everything:
                if t["accepted"] and "why" in t:
                    t["outcome"], t["why"] = "dropped at validation", "dropped: the tuned lists failed validation"
                t["accepted"] = False
            self.runs.expect(self.steps, "validation: the lists without tune's additions")
            self.candidate = self.lists
            self.configs["tuned lists"] = self.under(self.candidate)
            self.trajectories["tuned lists"] = []
            tuned = self.configs["tuned lists"]
            self.validation["tuned lists"] = self.train(tuned, losses=self.trajectories["tuned lists"])

    def acceptable(self, name):
        """Within ``tolerance`` of fp32, or no further from it than the starting lists."""
        v = self.validation
        gap = abs(v[name] - v["fp32"])
        return gap <= self.tolerance * abs(v["fp32"]) or gap <= abs(v["starting lists"] - v["fp32"])

    def time(self):
        """Step times in adjacent pairs with fp32's (one fp32 sample between two others each round: adjacent
        to both): fp32, the starting lists twice (two arms: the control, which must agree for any verdict),
        and the tuned lists where they differ from the starting lists (the same lists are one measurement,
        one verdict); a bf16 matrix product against fp32's, paired too (what the page says of this
        machine's arithmetic)."""
        names = list(self.configs)
        self.same_as = {}
        for i, name in enumerate(names):
            earlier = next((o for o in names[:i] if _same(self.configs[o], self.configs[name])), None)
            if earlier is not None:
                self.same_as[name] = earlier
        timed = {
            "fp32": None,
            "starting lists": self.configs["starting lists"],
            CONTROL: self.configs["starting lists"],
        }
        # the control's arms around one fp32 step each round (timing.paired groups the others in twos)
        timed.update({name: c for name, c in self.configs.items() if name not in self.same_as and name not in timed})
        self.runs.expect(len(timed) * self.pairs * PAIR_STEPS, "timing a step of each configuration")
        got = _paired_times(self.run, self.args, self.kwargs, self.guard, timed, self.pairs, "fp32")
        self.control = got.control("starting lists", CONTROL, timed="the starting lists")
        self.pairs_taken = {name: p for name, p in got.pairs.items() if name != CONTROL}
        self.samples = {"fp32": got.reference, **{name: got.samples(name) for name in self.pairs_taken}}
        self.samples = {name: [s.seconds for s in taken] for name, taken in self.samples.items()}
        self.timings = {name: statistics.median(s) for name, s in self.samples.items()}
        self.matmul = timing.matmul_ratio(self.start.options.low_precision_type, host.device_of(self.guard.modules))

    def result(self):
        # the result speaks the public names, as the files and reports do
        final = {k.name: sorted(v) for k, v in self.candidate.items()}
        final[PROMOTE.name] = sorted(self.candidate[PROMOTE] - self.candidate[LOWER] - self.candidate[FP32])
        result = TuneResult(
            final,
            {k.name: sorted(v) for k, v in self.start_lists.items()},
            self.report,
            self.trials,
            self.validation,
            self.timings,
            {k.name: v for k, v in self.configs["tuned lists"].modules.items()},
            self.proposals,
            self.module_proposals,
            self.samples,
            self.same_as,
            self.tolerance,
            self.start.options.low_precision_type,
            self.start.options.strict,
        )
        result.authored = self.authored  # large ops not tried: the author computes their input in float32
        result.runs = self.runs.done
        result.trajectories, result.steps, result.rounds = self.trajectories, self.steps, self.rounds
        result.start_modules = {k.name: v for k, v in self.start.modules.items()}
        result.start_whole = frozenset(k.name for k in self.start.replacing)
        result.pairs, result.matmul, result.control = self.pairs_taken, self.matmul, self.control
        return result


def tune(
    step_fn: Step,
    *args: Any,
    state: Iterable[object] = (),
    steps: int = 20,
    threshold: float = 0.05,
    loss_threshold: float = 2e-3,
    tolerance: float = 0.02,
    min_share: float = 0.02,
    rounds: int = 5,
    override_fp32: bool = False,
    progress: Callable[[int, int, str], None] | bool | None = None,
    **kwargs: Any,
) -> TuneResult:
    """Tune the lists for ``step_fn(*args, **kwargs)``, a training step that
    returns the loss.

    ``state``: the modules, optimizers, schedulers and tensors the step
    changes, as for audit (guard.StateGuard); they are as before when tune
    returns, also when it raises, and so is hmp's configuration. The step
    returns its loss (loss.step_loss). ``threshold``/``loss_threshold``: bounds
    on an op's own relative error and on the relative loss error it alone
    causes; ``tolerance``: how far the tuned lists' loss after ``steps``
    steps may be from fp32's; ``min_share``: the share of fp32 op time an op
    must take to be worth trying in bf16; ``rounds``: timing rounds (each
    trial's and the validation's; more narrow the spread).
    An op is added to the BF16 list only when, alone in bf16, its errors
    stay under the bounds and a step with it is measurably faster than
    without (timing.Ratio.faster, from ``rounds`` interleaved rounds); never
    an op whose input the model's author computes in float32 (an
    ``.float()``/``.to(torch.float32)`` or ``dtype=torch.float32`` before it
    in the same module, op_costs.py) unless ``override_fp32=True``.
    ``progress``: None shows the runs of the step as a bar on stderr once
    tune takes more than a few seconds; False shows nothing; a callable is
    called as ``progress(done, total, what)`` after each run of the step
    (``total`` grows as each phase learns how many runs it needs).
    A flagged op whose error is confined to the instances of one module
    class (confined_to()) keeps its list, and that class goes to the FP32
    list instead, when the op cast everywhere else stays within the bounds.
    A class whose own code makes an error above ``threshold`` (the audit's
    made_max_rel), still with the flagged ops moved, goes to FP32 too.
    """
    bounds = (threshold, loss_threshold, tolerance, min_share, steps, rounds)
    runs = StepRuns("hmp.tune", progress, label="tuning")
    result = None
    try:
        result = _Tuner(step_fn, args, kwargs, bounds, runs, override_fp32)(state)
        return result
    finally:
        runs.close(None if result is None else f"tuned in {runs.done} runs of the step")


def trial_outcome(trial, threshold, loss_threshold):
    """``(short, long)``: why a trial's op was kept in bf16 or not, for a chart's cell and in words: the bounds it
    broke, else what its step time said (speed.trial_speed)."""
    why = [] if trial["accepted"] else bounds_broken(trial, threshold, loss_threshold)
    if why:
        return "; ".join(why), "not kept: " + "; ".join(why)
    return speed.trial_speed(trial)


def _same(a, b):
    """Two conversions (None: fp32) that cast exactly alike."""
    if a is None or b is None:
        return a is b
    return _as_sets(a.lists) == _as_sets(b.lists) and a.modules == b.modules and a.options == b.options
