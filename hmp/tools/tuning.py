"""hmp.tune: lists that are fast and safe for this model.

1. audit the current lists; flagged ops move to the FP32 list, except where
   an op's error is confined to one module class: that class is proposed
   for the FP32 list instead (checked by a run with the op cast everywhere
   else), and the op keeps its list; a module class whose own code makes
   too much error, still with the flagged ops moved, is proposed too;
2. find the ops the step runs that are expensive and not in the BF16 list
   (unlisted or FP32-listed), try each alone in bf16, and keep those whose
   own error and the error they pass on to the loss stay under the bounds;
3. validate: train a few steps from the same state in fp32, with the current
   lists and with the candidate; if the candidate's loss strays from fp32's,
   drop the additions and module proposals; time a step of each.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode

from hmp.core.hints import Step
from hmp.core.lists import KINDS
from hmp.core.resolve import Resolver
from hmp.core.switches import casts_enabled
from hmp.driver.conversion import applied
from hmp.tools.auditing import audit_with, by_op, compare, in_force_or_default, kind_of, made_in, pairs, run_step, worst
from hmp.tools.guard import StateGuard
from hmp.tools.loss import step_loss
from hmp.tools.record import within
from hmp.tools.target import user_name
from hmp.tools.tune_result import TuneResult

# calls a step makes that are not math to run in another dtype (indexing only moves values: in the
# BF16 list it would only round them)
NOT_CANDIDATES = frozenset(
    (
        "backward",
        "to",
        "type",
        "float",
        "double",
        "half",
        "bfloat16",
        "detach",
        "clone",
        "copy_",
        "item",
        "tolist",
        "numpy",
        "contiguous",
        "view",
        "reshape",
        "size",
        "dim",
        "getitem",
    )
)


def _floating(value):
    if isinstance(value, torch.Tensor):
        return value.is_floating_point()
    return isinstance(value, (list, tuple)) and any(_floating(v) for v in value)


def _has_fp32(value):
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.float32
    return isinstance(value, (list, tuple)) and any(_has_fp32(v) for v in value)


class _OpTimes(TorchFunctionMode):
    """Time per top-level torch call that takes float32 tensors and returns
    floating ones, by op name: under the current lists, the ops that still
    compute in fp32 (hmp's own wrappers are outermost, so ops they call are
    not seen)."""

    def __init__(self):
        super().__init__()
        self.seconds = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        elapsed = time.perf_counter() - start
        name = getattr(func, "__name__", "")
        if not casts_enabled():  # the optimizer step under disable_casts(), not the model
            return out
        if name.endswith("_") and not name.endswith("__"):
            return out
        if name.startswith("__") and name.endswith("__"):
            name = name[2:-2]
            if name[:1] in ("r", "i") and name[1:] in ("add", "sub", "mul", "matmul", "truediv", "pow", "div"):
                name = name[1:]
        if name in NOT_CANDIDATES:
            return out
        if not (_floating(out) and (_has_fp32(list(args)) or _has_fp32(list(kwargs.values())))):
            return out
        self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
        return out


def _as_sets(lists):
    return {k: set(v) for k, v in lists.items()}


def _as_float(value):
    return float(step_loss(value, "hmp.tune").detach().double().mean())


def _train(fn, args, kwargs, guard, steps, conversion):
    """fn's value after ``steps`` calls from the guarded state under
    ``conversion`` (None: plain torch), and the step times."""
    times, value = [], None
    with guard.running(), applied(conversion):
        for _ in range(steps):
            start = time.perf_counter()
            value = fn(*args, **kwargs)
            times.append(time.perf_counter() - start)
    return _as_float(value), times


class StepDoesNotTrain(ValueError):
    """The step's loss does not move from one step to the next: it does not train."""


def check_trains(fn, args, kwargs, guard, steps=3):
    """Raise StepDoesNotTrain when ``steps`` fp32 steps from the guarded
    state all return the same loss: a step that only runs the forward
    (no backward, no optimizer step) gives tune nothing to compare."""
    with guard.running(), applied(None):
        losses = [_as_float(fn(*args, **kwargs)) for _ in range(steps)]
    if len(set(losses)) == 1:
        raise StepDoesNotTrain(
            f"hmp.tune: the step's loss did not move over {steps} steps in fp32 (each {losses[0]:.6g}), so it does "
            f"not train: tune compares training under the lists with training in fp32. The step must run "
            f"loss.backward() and optimizer.step() and return the loss."
        )


def _interleaved_times(fn, args, kwargs, guard, configs, rounds, tick=lambda what: None):
    """Every step time per configuration (the first of each round left out:
    it pays convert's first calls), configurations interleaved so load from
    elsewhere falls on each alike."""
    samples = {name: [] for name in configs}
    for i in range(rounds):
        for name, conversion in configs.items():
            samples[name] += _train(fn, args, kwargs, guard, 3, conversion)[1][1:]
        tick(f"timing round {i + 1}/{rounds}")
    return samples


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


class _Tuner:
    """One tune() run, a method per phase; the state they share is on self."""

    def __init__(self, step_fn, args, kwargs, bounds, progress):
        self.fn, self.args, self.kwargs, self.progress = step_fn, args, kwargs, progress
        self.threshold, self.loss_threshold, self.tolerance, self.min_share, self.steps, self.rounds = bounds
        self.start = in_force_or_default()
        self.start_lists = _as_sets(self.start.lists)
        self.done, self.total = 0, None

    def under(self, lists, fp32_modules=()):
        """The starting conversion with ``lists`` and ``fp32_modules`` added to its FP32 module entries."""
        fp32 = tuple(dict.fromkeys(self.start.modules["fp32"] + tuple(fp32_modules)))
        return self.start._replace(lists=lists, modules={"bf16": self.start.modules["bf16"], "fp32": fp32})

    def tick(self, what):
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total, what)

    def run_step(self, conversion, **options):
        return run_step(self.fn, self.args, self.kwargs, self.guard, conversion, **options)

    def train(self, conversion, steps=None):
        return _train(self.fn, self.args, self.kwargs, self.guard, steps or self.steps, conversion)

    def __call__(self, state):
        self.guard = StateGuard("hmp.tune", state, self.args, self.kwargs, self.fn)
        try:
            check_trains(self.fn, self.args, self.kwargs, self.guard)
            self.audit()
            self.find_candidates()
            self.trials = {op: self.try_in_bf16(op) for op in self.candidates}
            self.proposals = {op: self.try_class_instead(op, cls) for op, cls in self.confined.items()}
            self.module_proposals = {}
            for row in self.classes:
                self.try_class(row)
            self.validate()
            self.time()
        finally:
            self.guard.restore()
        return self.result()

    def audit(self):
        """Audit the starting lists; the flagged ops move to FP32 (self.lists)."""
        if self.progress is not None:
            self.progress(0, None, "audit")
        self.report = audit_with(self.guard, self.fn, self.args, self.kwargs, self.threshold, self.loss_threshold)
        self.lists = _as_sets(self.start_lists)
        for op in self.report.flagged:
            for k in KINDS:
                self.lists[k].discard(op)
            self.lists["fp32"].add(op)
        self.confined = {
            op: cls for op in self.report.flagged if (cls := confined_to(self.report, op, self.guard.modules))
        }

    def find_candidates(self):
        """What still computes in fp32 under the lists so far and takes at
        least ``min_share`` of the step's op time, and the fp32 reference
        run that records its outputs (and the confined ops') uncast."""
        times = _OpTimes()
        with self.guard.running(), applied(self.under(self.lists)), times:
            self.fn(*self.args, **self.kwargs)
        total = sum(times.seconds.values()) or 1.0
        resolver = Resolver()
        self.seconds = times.seconds
        self.candidates = [
            op
            for op, s in times.seconds.items()
            if s / total >= self.min_share
            and op not in self.lists["bf16"]
            and op not in self.report.flagged
            and resolver.exists(op)
        ]
        watch = {"bf16": set(self.candidates) | set(self.confined), "fp32": set(), "promote": set()}
        self.ref_final, self.ref = self.run_step(
            self.under(watch), passthrough=True, keep_outputs=True, module_outputs=True
        )
        self.ref_outputs = by_op(self.ref.outputs)
        self.classes = [row for row in self.report.module_classes if row["made_max_rel"] > self.threshold]
        self.total = self.done + len(self.candidates) + len(self.confined) + len(self.classes) + 3 + self.rounds

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
        trial = {
            "was": kind_of(op, self.lists),
            "seconds": self.seconds[op],
            **self.alone(op, {"bf16": {op}, "fp32": set(), "promote": set()}),
        }
        self.tick(f"{op} tried in bf16")
        return trial

    def try_class_instead(self, op, cls):
        """The flagged ``op`` cast where its starting list says, with ``cls`` in FP32."""
        only = {k: ({op} if op in self.start_lists[k] else set()) for k in KINDS}
        proposal = {"class": user_name(cls), "type": cls, **self.alone(op, only, [cls])}
        self.tick(f"{op} with {cls.__name__} in FP32")
        return proposal

    def try_class(self, row):
        """A module class whose own code makes too much error (audit's "error made in it"), measured again
        with the flagged ops moved: proposed for FP32 when it still makes it."""
        cls = row["type"]
        self.tick(f"module class {cls.__name__}")
        if cls in self.confined.values() or any(isinstance(r, cls) for r in self.guard.modules):
            return
        made = made_in(self.fn, self.args, self.kwargs, self.guard, self.under(self.lists), self.ref, row["paths"])
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
                for k in KINDS:
                    candidate[k].discard(op)
                candidate["bf16"].add(op)
        for op, p in self.proposals.items():
            if p["accepted"]:  # the op keeps its starting list; its class goes to FP32
                for k in KINDS:
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
        self.validation = {}
        for name, conversion in self.configs.items():
            self.validation[name] = self.train(conversion)[0]
            self.tick(f"validation: {name}")
        if not self.acceptable("tuned lists") and (self.candidate != self.lists or to_fp32):
            everything = [*self.trials.values(), *self.proposals.values(), *self.module_proposals.values()]
            for t in everything:
                t["accepted"] = False
            self.candidate = self.lists
            self.configs["tuned lists"] = self.under(self.candidate)
            self.validation["tuned lists"] = self.train(self.configs["tuned lists"])[0]

    def acceptable(self, name):
        """Within ``tolerance`` of fp32, or no further from it than the starting lists."""
        v = self.validation
        gap = abs(v[name] - v["fp32"])
        return gap <= self.tolerance * abs(v["fp32"]) or gap <= abs(v["starting lists"] - v["fp32"])

    def time(self):
        """Step times of every configuration, interleaved; which configurations are the same lists."""
        self.samples = _interleaved_times(
            self.fn, self.args, self.kwargs, self.guard, self.configs, self.rounds, self.tick
        )
        self.timings = {name: statistics.median(s) for name, s in self.samples.items()}
        names = list(self.configs)
        self.same_as = {}
        for i, name in enumerate(names):
            earlier = next((o for o in names[:i] if _same(self.configs[o], self.configs[name])), None)
            if earlier is not None:
                self.same_as[name] = earlier

    def result(self):
        final = {k: sorted(v) for k, v in self.candidate.items()}
        final["promote"] = sorted(self.candidate["promote"] - self.candidate["bf16"] - self.candidate["fp32"])
        return TuneResult(
            final,
            {k: sorted(v) for k, v in self.start_lists.items()},
            self.report,
            self.trials,
            self.validation,
            self.timings,
            self.configs["tuned lists"].modules,
            self.proposals,
            self.module_proposals,
            self.samples,
            self.same_as,
            self.tolerance,
            self.start.options.low,
        )


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
    progress: Callable[[int, int | None, str], None] | None = None,
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
    must take to be worth trying in bf16; ``rounds``: timing rounds.
    ``progress``: called as ``progress(done, total, what)`` after each unit
    of work once the audit is done (each trial, validation run and timing
    round; ``total`` is known from then on), and as ``progress(0, None,
    "audit")`` before the audit.
    A flagged op whose error is confined to the instances of one module
    class (confined_to()) keeps its list, and that class goes to the FP32
    list instead, when the op cast everywhere else stays within the bounds.
    A class whose own code makes an error above ``threshold`` (the audit's
    made_max_rel), still with the flagged ops moved, goes to FP32 too.
    """
    bounds = (threshold, loss_threshold, tolerance, min_share, steps, rounds)
    return _Tuner(step_fn, args, kwargs, bounds, progress)(state)


def _same(a, b):
    """Two conversions (None: fp32) that cast exactly alike."""
    if a is None or b is None:
        return a is b
    return _as_sets(a.lists) == _as_sets(b.lists) and a.modules == b.modules and a.options == b.options
