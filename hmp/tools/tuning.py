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

import math
import statistics
import time
from datetime import datetime, timezone
from typing import Any, Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode

from hmp.core.casts import casts_enabled
from hmp.core.conversion import applied
from hmp.core.hints import Step
from hmp.core.lists import KINDS, class_path
from hmp.core.resolve import Resolver
from hmp.tools import tuned_files
from hmp.tools.auditing import audit_with, by_op, compare, in_force_or_default, kind_of, made_in, pairs, run_step, worst
from hmp.tools.files import write_all
from hmp.tools.guard import StateGuard
from hmp.tools.loss import step_loss
from hmp.tools.record import within
from hmp.tools.report import write as write_html

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


class TuneResult:
    def __init__(
        self,
        lists,
        before,
        audit_report,
        trials,
        validation,
        timings,
        modules=None,
        proposals=None,
        module_proposals=None,
        samples=None,
        same_as=None,
        tolerance=0.02,
        low=torch.bfloat16,
    ):
        self.lists = lists  # {"bf16", "fp32", "promote"} -> sorted names
        self.before = before
        self.audit = audit_report
        self.trials = trials  # op -> {"seconds", "own_max_rel", "loss_error", "nonfinite", "accepted"}
        self.validation = validation  # name -> final loss after the validation steps
        self.timings = timings  # name -> median step seconds
        self.modules = modules or {"bf16": (), "fp32": ()}  # module entries: classes and instances
        # op -> {"class", "type", "own_max_rel", "loss_error", "nonfinite", "accepted"}: the module
        # class its error is confined to, and the op's errors with that class in FP32
        self.proposals = proposals or {}
        # class path -> {"class", "type", "made_max_rel", "loss_error", "nonfinite", "accepted"}: a module
        # class whose own code makes too much error (with the flagged ops moved), and the loss error with it
        # in FP32
        self.module_proposals = module_proposals or {}
        self.samples = samples or {}  # name -> every step time measured (seconds), for the spread
        self.same_as = same_as or {}  # name -> an earlier configuration with exactly the same lists and modules
        self.tolerance = tolerance
        self.low = low  # the lower dtype: which default list the files written extend

    def spread(self, name):
        """The relative spread of ``name``'s step times: (75th - 25th
        percentile) / median; what two medians must differ by to mean more
        than noise on this machine now. None with fewer than 4 samples."""
        times = sorted(self.samples.get(name, ()))
        if len(times) < 4:
            return None
        q1, _, q3 = statistics.quantiles(times, n=4)
        return (q3 - q1) / statistics.median(times)

    def loss_gap(self, name):
        """``name``'s final loss relative to fp32's: (loss - fp32) / |fp32|;
        against an fp32 loss of exactly 0, 0 when equal, else signed inf."""
        diff, ref = self.validation[name] - self.validation["fp32"], abs(self.validation["fp32"])
        if ref == 0:
            return math.copysign(math.inf, diff) if diff else 0.0
        return diff / ref

    @property
    def verdict(self):
        """One line: the tuned lists' loss against fp32's and the tolerance."""
        gap, start = self.loss_gap("tuned lists"), self.loss_gap("starting lists")
        within = abs(gap) <= self.tolerance
        line = (
            f"verdict: the tuned lists end {gap:+.2%} from fp32's loss, "
            f"{'within' if within else 'OUTSIDE'} the {self.tolerance:.0%} tolerance (starting lists: {start:+.2%})"
        )
        if not within:
            line += (
                "; tune kept no addition that made it worse than the starting lists, so the rest is the "
                "lower dtype's on this model: put the model's most sensitive module classes in the FP32 list "
                "(the audit's module table), or validate over more steps"
            )
        timed = [n for n in ("fp32", "tuned lists") if n in self.timings]
        if len(timed) == 2:
            ratio = self.timings["tuned lists"] / self.timings["fp32"]
            noise = max(filter(None, (self.spread(n) for n in timed)), default=None)
            line += f"; a step takes {ratio:.2f}x fp32's time"
            if noise is not None and abs(ratio - 1) <= noise:
                line += f" (within this machine's timing noise, {noise:.0%}: no measurable difference)"
        return line

    @property
    def moved_to_fp32(self):
        return sorted(set(self.lists["fp32"]) - set(self.before["fp32"]))

    @property
    def added_to_bf16(self):
        return sorted(set(self.lists["bf16"]) - set(self.before["bf16"]))

    @property
    def modules_to_fp32(self):
        """The module classes tune put under the FP32 rule."""
        proposed = list(self.proposals.values()) + list(self.module_proposals.values())
        return list(dict.fromkeys(p["type"] for p in proposed if p["accepted"]))

    def table(self):
        lines = [
            "## audit of the starting lists",
            "",
            self.audit.table(),
            "",
            "## ops tried in bf16",
            "",
            "| op | was in | fp32 time ms | own max rel err | error passed to loss | inf/NaN | kept in bf16 |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        for op, t in sorted(self.trials.items(), key=lambda kv: -kv[1]["seconds"]):
            lines.append(
                f"| {op} | {t['was'] or 'no list'} | {t['seconds'] * 1e3:.3f} | {t['own_max_rel']:.3g} | "
                f"{t['loss_error']:.3g} | {t['nonfinite']} | {'yes' if t['accepted'] else 'no'} |"
            )
        if self.proposals:
            lines += [
                "",
                "## flagged ops whose error is confined to one module class",
                "",
                "| op | module class | own max rel err, class in FP32 | error passed to loss | inf/NaN | "
                "class to FP32 instead of the op |",
                "|---|---|---:|---:|---:|---|",
            ]
            for op, p in self.proposals.items():
                lines.append(
                    f"| {op} | {p['class']} | {p['own_max_rel']:.3g} | {p['loss_error']:.3g} | "
                    f"{p['nonfinite']} | {'yes' if p['accepted'] else 'no'} |"
                )
        if self.module_proposals:
            lines += [
                "",
                "## module classes whose own code makes too much error",
                "",
                "| module class | error made in it | error passed to loss, class in FP32 | inf/NaN | to FP32 |",
                "|---|---:|---:|---:|---|",
            ]
            for p in self.module_proposals.values():
                lines.append(
                    f"| {p['class']} | {p['made_max_rel']:.3g} | {p['loss_error']:.3g} | {p['nonfinite']} | "
                    f"{'yes' if p['accepted'] else 'no'} |"
                )
        lines += [
            "",
            "## validation",
            "",
            "| lists | final loss | vs fp32 | step ms (median) | spread | timings |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name in self.validation:
            ms, spread = self.timings.get(name), self.spread(name)
            note = f" (same lists as {self.same_as[name]})" if name in self.same_as else ""
            lines.append(
                f"| {name}{note} | {self.validation[name]:.5f} | {self.loss_gap(name):+.2%} | "
                f"{'' if ms is None else f'{ms * 1e3:.2f}'} | {'' if spread is None else f'±{spread / 2:.0%}'} | "
                f"{len(self.samples.get(name, ()))} |"
            )
        if self.same_as:
            lines += [
                "",
                "same lists, so any difference between their step times above is this machine's "
                "timing noise: " + ", ".join(f"{a} = {b}" for a, b in self.same_as.items()),
            ]
        lines += ["", self.verdict]
        lines += [
            "",
            f"moved to FP32: {', '.join(self.moved_to_fp32) or 'none'}",
            f"module classes to FP32: {', '.join(map(class_path, self.modules_to_fp32)) or 'none'}",
            f"added to BF16: {', '.join(self.added_to_bf16) or 'none'}",
        ]
        return "\n".join(lines)

    def __str__(self):
        return self.table()

    def save_html(self, path):
        """One self-contained HTML file (hmp/tools/report.py): the audit's errors
        per op and module, the ops tried, the validation and the verdict."""
        write_html(path, tune=self)

    def write(self, bf16_path, fp32_path, promote_path=None):
        """Write list files that hmp.convert() loads, each extending the
        default list (tuned_files.texts: ``include default`` and tune's
        changes, module classes as their import paths). All or nothing
        (files.write_all): raises ValueError, writing nothing, when a class
        does not load by its import path, when two paths are the same file,
        or when a path cannot be written."""
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        summary = (
            f"# written by hmp.tune on {stamp}\n"
            f"# moved to FP32 (flagged by the audit): {', '.join(self.moved_to_fp32) or 'none'}\n"
            f"# module classes to FP32 (a flagged op's error is confined to them): "
            f"{', '.join(map(class_path, self.modules_to_fp32)) or 'none'}\n"
            f"# added to BF16 (safe and expensive): {', '.join(self.added_to_bf16) or 'none'}\n"
            f"# validation final losses: " + ", ".join(f"{k} {v:.5f}" for k, v in self.validation.items()) + "\n"
        )
        targets = [("bf16", bf16_path), ("fp32", fp32_path)] + ([("promote", promote_path)] if promote_path else [])
        write_all(tuned_files.texts(self.lists, self.modules, targets, summary, self.low), "hmp.tune")


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
    start = in_force_or_default()
    start_lists = _as_sets(start.lists)

    def under(lists, fp32_modules=()):
        fp32 = tuple(dict.fromkeys(start.modules["fp32"] + tuple(fp32_modules)))
        return start._replace(lists=lists, modules={"bf16": start.modules["bf16"], "fp32": fp32})

    guard = StateGuard("hmp.tune", state, args, kwargs, step_fn)
    done, total = 0, None

    def tick(what):
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, what)

    try:
        check_trains(step_fn, args, kwargs, guard)
        if progress is not None:
            progress(0, None, "audit")
        report = audit_with(guard, step_fn, args, kwargs, threshold, loss_threshold)
        lists = _as_sets(start_lists)
        for op in report.flagged:
            for k in KINDS:
                lists[k].discard(op)
            lists["fp32"].add(op)
        confined = {op: cls for op in report.flagged if (cls := confined_to(report, op, guard.modules)) is not None}

        # what still computes in fp32 under the lists so far, and its share of the step's op time
        times = _OpTimes()
        with guard.running(), applied(under(lists)), times:
            step_fn(*args, **kwargs)
        total = sum(times.seconds.values()) or 1.0
        resolver = Resolver()
        candidates = [
            op
            for op, s in times.seconds.items()
            if s / total >= min_share and op not in lists["bf16"] and op not in report.flagged and resolver.exists(op)
        ]
        # the fp32 reference, recording the candidates' and the confined ops' outputs without casting
        watch = {"bf16": set(candidates) | set(confined), "fp32": set(), "promote": set()}
        ref_final, ref = run_step(
            step_fn, args, kwargs, guard, under(watch), passthrough=True, keep_outputs=True, module_outputs=True
        )
        ref_outputs = by_op(ref.outputs)
        classes = [row for row in report.module_classes if row["made_max_rel"] > threshold]
        total = done + len(candidates) + len(confined) + len(classes) + 3 + rounds

        def alone(op, only, fp32_modules=()):
            """Errors of ``op`` cast alone (its list in ``only``), against the reference."""
            own_final, own = run_step(
                step_fn, args, kwargs, guard, under(only, fp32_modules), keep_outputs=True, restore_dtype=True
            )
            loss_error, _, nonfinite = compare(ref_final, own_final)
            own_max_rel, _, own_nonfinite = worst(pairs(ref_outputs, by_op(own.outputs), op))
            stats = own.stats.get(op)
            ok = (
                stats is not None
                and stats.casts > 0
                and own_max_rel <= threshold
                and loss_error <= loss_threshold
                and not (nonfinite or own_nonfinite)
            )
            return {
                "own_max_rel": own_max_rel,
                "loss_error": loss_error,
                "nonfinite": nonfinite + own_nonfinite,
                "accepted": ok,
            }

        trials = {}
        for op in candidates:
            trials[op] = {
                "was": kind_of(op, lists),
                "seconds": times.seconds[op],
                **alone(op, {"bf16": {op}, "fp32": set(), "promote": set()}),
            }
            tick(f"{op} tried in bf16")
        proposals = {}
        for op, cls in confined.items():
            only = {k: ({op} if op in start_lists[k] else set()) for k in KINDS}
            proposals[op] = {"class": class_path(cls), "type": cls, **alone(op, only, [cls])}
            tick(f"{op} with {cls.__name__} in FP32")
        # module classes whose own code makes too much error (audit's "error made in it"), measured
        # again with the flagged ops moved: a class that still makes it goes to FP32
        module_proposals = {}
        for row in classes:
            cls = row["type"]
            tick(f"module class {cls.__name__}")
            if cls in confined.values() or any(isinstance(r, cls) for r in guard.modules):
                continue
            made = made_in(step_fn, args, kwargs, guard, under(lists), ref, row["paths"])
            made_max_rel = max((m[0] for m in made.values()), default=0.0)
            fp32_final, _ = run_step(step_fn, args, kwargs, guard, under(lists, [cls]))
            loss_error, _, nonfinite = compare(ref_final, fp32_final)
            module_proposals[row["class"]] = {
                "class": row["class"],
                "type": cls,
                "made_max_rel": made_max_rel,
                "loss_error": loss_error,
                "nonfinite": nonfinite,
                "accepted": made_max_rel > threshold and not nonfinite,
            }
        candidate = _as_sets(lists)
        for op, t in trials.items():
            if t["accepted"]:
                for k in KINDS:
                    candidate[k].discard(op)
                candidate["bf16"].add(op)
        for op, p in proposals.items():
            if p["accepted"]:  # the op keeps its starting list; its class goes to FP32
                for k in KINDS:
                    candidate[k].discard(op)
                    if op in start_lists[k]:
                        candidate[k].add(op)
        to_fp32 = [p["type"] for p in list(proposals.values()) + list(module_proposals.values()) if p["accepted"]]

        configs = {"fp32": None, "starting lists": under(start_lists), "tuned lists": under(candidate, to_fp32)}
        validation = {}
        for name, conversion in configs.items():
            validation[name] = _train(step_fn, args, kwargs, guard, steps, conversion)[0]
            tick(f"validation: {name}")

        def acceptable(name):
            """Within ``tolerance`` of fp32, or no further from it than the starting lists."""
            gap = abs(validation[name] - validation["fp32"])
            return gap <= tolerance * abs(validation["fp32"]) or gap <= abs(
                validation["starting lists"] - validation["fp32"]
            )

        if not acceptable("tuned lists") and (candidate != lists or to_fp32):
            for t in list(trials.values()) + list(proposals.values()) + list(module_proposals.values()):
                t["accepted"] = False
            candidate, to_fp32 = lists, []
            configs["tuned lists"] = under(candidate)
            validation["tuned lists"] = _train(step_fn, args, kwargs, guard, steps, configs["tuned lists"])[0]
        samples = _interleaved_times(step_fn, args, kwargs, guard, configs, rounds, tick)
        timings = {name: statistics.median(s) for name, s in samples.items()}
        same_as = {}
        for i, name in enumerate(configs):
            earlier = next((other for other in list(configs)[:i] if _same(configs[other], configs[name])), None)
            if earlier is not None:
                same_as[name] = earlier
    finally:
        guard.restore()
    final = {k: sorted(v) for k, v in candidate.items()}
    final["promote"] = sorted(candidate["promote"] - candidate["bf16"] - candidate["fp32"])
    return TuneResult(
        final,
        {k: sorted(v) for k, v in start_lists.items()},
        report,
        trials,
        validation,
        timings,
        configs["tuned lists"].modules,
        proposals,
        module_proposals,
        samples,
        same_as,
        tolerance,
        start.options.low,
    )


def _same(a, b):
    """Two conversions (None: fp32) that cast exactly alike."""
    if a is None or b is None:
        return a is b
    return _as_sets(a.lists) == _as_sets(b.lists) and a.modules == b.modules and a.options == b.options
