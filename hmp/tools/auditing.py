"""hmp.audit: where does bf16 hurt this model?

Runs a step in fp32 and under hmp from the same state and RNG, pairs each
listed op's outputs by call order, and for every op that casts, runs once
more with only that op cast to see the error it alone passes on to the
step's output (the loss). Everything the step changes is put back before
every run and at the end (hmp/tools/guard.py).

The recorded runs also hook the modules among the step's state and
arguments (hmp/tools/record.py): each module's outputs are paired by call order
too, and each op call is attributed to the innermost module it ran in, so
the ops' own errors add up per module and per module class. One more run
per module class measures the error its instances' own code makes: only
the ops called directly in them cast (record.Confinement). The last runs,
warm by then, time each op: in fp32 and under the lists, interleaved, a few
times each (op_times()).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Callable, Iterable

import torch

from hmp.binding import kinds
from hmp.binding.pays import CAST
from hmp.core.hints import Step
from hmp.driver.conversion import applied
from hmp.driver.plan import Requested, plan
from hmp.driver.queries import decisions, in_force
from hmp.tools import host, speed
from hmp.tools.guard import StateGuard
from hmp.tools.loss import step_loss
from hmp.tools.op_costs import NOT_TIMED, TIMED_PAIRS, op_times
from hmp.tools.progress import StepRuns
from hmp.tools.record import Confinement, ModuleHooks, Recorder, module_paths, ran_in
from hmp.tools.report.page import write as write_html
from hmp.tools.target import user_name

TINY = 1e-30
QUIET = StepRuns("", False)  # counts nothing anyone sees: audit_with() called without a counter
TOP = 10  # module rows table() shows; all are in AuditReport.modules / .module_classes


def _final(value, tool):
    """What a run's errors are measured on: the step's loss (loss.step_loss)."""
    return (step_loss(value, tool).detach().clone(),)


def compare(ref, got):
    """Errors of ``got`` against ``ref`` (tuples of tensors of equal shapes):
    max and mean error relative to the reference's scale, and the number of
    elements that are finite in ``ref`` but not in ``got``."""
    max_rel = mean_rel = 0.0
    nonfinite = 0
    for r, g in zip(ref, got):
        if r.shape != g.shape:
            continue
        r, g = r.double(), g.double()
        both = torch.isfinite(r) & torch.isfinite(g)
        nonfinite += int((torch.isfinite(r) & ~torch.isfinite(g)).sum())
        if both.any():
            diff, scale = (g - r).abs()[both], r.abs()[both]
            max_rel = max(max_rel, float(diff.max() / (scale.max() + TINY)))
            mean_rel = max(mean_rel, float(diff.mean() / (scale.mean() + TINY)))
    return max_rel, mean_rel, nonfinite


class AuditReport:
    def __init__(
        self, rows, output_error, threshold, loss_threshold, modules=(), seen=None, time_ratio=None, uncast=None
    ):
        self.rows = rows  # one dict per op that ran
        self.output_error = output_error  # relative error of fn's output under full hmp
        self.threshold, self.loss_threshold = threshold, loss_threshold
        self.modules = list(modules)  # one dict per hooked module that ran, by path
        self.module_classes = _class_rows(self.modules, threshold)  # the same, per module class
        # module class -> the largest integer input (position, timestep, id) its instances were given:
        # an error that grows with positions or timesteps is measured only up to there
        self.seen = dict(seen or {})
        # the listed ops' time under the lists relative to fp32 (timing.Ratio), None when not timed
        self.time_ratio = time_ratio
        self.uncast = dict(uncast or {})  # why hmp does not cast them -> entries ("kind name"; queries.decisions)
        self.created = datetime.now(timezone.utc)  # when measured, for the HTML report's title
        self.step_ms = {}  # "fp32"/"lists" -> median wall time of the runs the op times come from

    def save_html(self, path, title=None):
        """Write the report as one self-contained HTML page with inline SVG
        charts (report.write: atomic; ValueError naming ``path`` when it
        cannot be written)."""
        write_html(path, audit=self, title=title)

    @property
    def flagged(self):
        return sorted(r["op"] for r in self.rows if r["flagged"])

    @property
    def flagged_modules(self):
        """Import paths of the module classes in which an op's own error exceeds ``threshold``."""
        return sorted(r["class"] for r in self.module_classes if r["flagged"])

    def table(self):
        lines = [
            f"output (loss) relative error under hmp: {self.output_error:.3g}",
            f"listed ops' forward time under the lists: {speed.words(self.time_ratio, control_of='the lists')}",
            "",
            "| op | list | calls | max rel err | mean rel err | own max rel err | inf/NaN introduced "
            "| error passed to loss | flagged |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in sorted(self.rows, key=lambda r: -r["loss_error"]):  # "-": casts nothing, never run cast alone
            own, passed = (f"{r['own_max_rel']:.3g}", f"{r['loss_error']:.3g}") if r.get("casts", 1) else ("-", "-")
            lower = "/".join(d for d in r.get("ran_in", "").split(",") if d in ("bfloat16", "float16"))
            kind = r["list"] or (f"none, ran in {lower}" if lower else "none")  # as the HTML's badge says
            lines.append(
                f"| {r['op']} | {kind} | {r['calls']} | {r['max_rel']:.3g} | {r['mean_rel']:.3g} | "
                f"{own} | {r['nonfinite']} | {passed} | {r['reason'] or ''} |"
            )
        lines += [] if all(r.get("casts", 1) for r in self.rows) else ["", "-: the op casts nothing: no own error"]
        for what, rows, columns in (
            ("modules", self.modules, MODULE_COLUMNS),
            ("module classes", self.module_classes, CLASS_COLUMNS),
        ):
            if rows:
                lines += [
                    "",
                    _heading(what, len(rows)),
                    "",
                    "| " + " | ".join(title for title, _, _ in columns) + " |",
                    "|" + "|".join(align for _, align, _ in columns) + "|",
                ]
                lines += ["| " + " | ".join(cell(r) for _, _, cell in columns) + " |" for r in _by_error(rows)[:TOP]]
        if self.uncast:
            lines += ["", "List entries hmp does not cast, and why:", ""]
            lines += [f"- {', '.join(entries)}: {why}" for why, entries in self.uncast.items()]
        if self.seen:
            lines += [
                "",
                "What this audit could not see: the module classes below were given integer inputs "
                "(positions, timesteps, ids) up to the value shown, and an error that grows with position or "
                "timestep (rotary or sinusoidal embeddings) is measured only up to there. Audit with inputs "
                "that reach the positions and timesteps you run at.",
                "",
                "| class | largest integer input seen |",
                "|---|---:|",
            ]
            lines += [f"| {cls} | {value} |" for cls, value in sorted(self.seen.items(), key=lambda kv: -kv[1])[:TOP]]
        return "\n".join(lines)

    def __str__(self):
        return self.table()


def _own_error_cell(row):
    return f"{row['own_max_rel']:.3g} ({row['own_op']})" if row["own_op"] else "-"


# (title, alignment, cell) of the module tables' columns
MODULE_COLUMNS = (
    ("module", "---", lambda r: r["path"] or "(root)"),
    ("class", "---", lambda r: r["class"]),
    ("calls", "---:", lambda r: str(r["calls"])),
    ("output max rel err", "---:", lambda r: f"{r['max_rel']:.3g}"),
    ("output mean rel err", "---:", lambda r: f"{r['mean_rel']:.3g}"),
    ("error made in it", "---:", lambda r: f"{r['made_max_rel']:.3g}"),
    ("largest own op error in it", "---:", _own_error_cell),
)
CLASS_COLUMNS = (
    ("class", "---", lambda r: r["class"]),
    ("instances", "---:", lambda r: str(r["instances"])),
    ("calls", "---:", lambda r: str(r["calls"])),
    ("output max rel err", "---:", lambda r: f"{r['max_rel']:.3g}"),
    ("error made in it", "---:", lambda r: f"{r['made_max_rel']:.3g}"),
    ("largest own op error in it", "---:", _own_error_cell),
    ("flagged", "---", lambda r: r["reason"]),
)


def _heading(what, count):
    shown = f"the {TOP} with the largest error made in it" if count > TOP else "by error made in it"
    return (
        f"{what} ({count}; {shown}; error made in it: at its outputs, when only the ops called directly in it "
        f"cast, from fp32 inputs; own op error: of one op called directly in it, cast alone):"
    )


def _by_error(rows):
    return sorted(rows, key=lambda r: (-max(r["made_max_rel"], r["own_max_rel"]), -r["max_rel"]))


def _module_rows(paths, ref, full, ops, made):
    """One row per hooked module that ran under hmp: its outputs against the
    fp32 run's, the error its own code makes (``made``, from made_by_class()),
    and the largest own error (``ops``' ``own_by_module``) of the ops called
    directly in it."""
    ref_outputs, full_outputs = by_op(ref.module_outputs), by_op(full.module_outputs)
    rows = []
    for path, module in paths.items():
        if path not in full_outputs:
            continue
        max_rel, mean_rel, nonfinite = worst(pairs(ref_outputs, full_outputs, path))
        own = {r["op"]: r["own_by_module"][path] for r in ops if path in r["own_by_module"]}
        own_op = max(own, key=own.get, default=None)
        rows.append(
            {
                "path": path,
                "class": user_name(type(module)),
                "type": type(module),
                "calls": len(full_outputs[path][None]),
                "max_rel": max_rel,
                "mean_rel": mean_rel,
                "nonfinite": nonfinite,
                "own_max_rel": own.get(own_op, 0.0),
                "own_op": own_op,
                "made_max_rel": made.get(path, (0.0,))[0],
            }
        )
    return rows


def _class_rows(module_rows, threshold):
    """``module_rows`` aggregated per class: the largest errors of its
    instances; flagged when an op's own error in one, or the error one's
    own code makes, exceeds ``threshold``."""
    by_class = {}
    for r in module_rows:
        by_class.setdefault(r["type"], []).append(r)
    rows = []
    for cls, instances in by_class.items():
        top = max(instances, key=lambda r: r["own_max_rel"])
        made = max(r["made_max_rel"] for r in instances)
        if top["own_max_rel"] > threshold:
            reason = f"{top['own_op']} error {top['own_max_rel']:.2g} > {threshold:g}"
        elif made > threshold:
            reason = f"error made in it {made:.2g} > {threshold:g}"
        else:
            reason = ""
        rows.append(
            {
                "class": user_name(cls),
                "type": cls,
                "instances": len(instances),
                "paths": [r["path"] for r in instances],
                "calls": sum(r["calls"] for r in instances),
                "max_rel": max(r["max_rel"] for r in instances),
                "mean_rel": max(r["mean_rel"] for r in instances),
                "nonfinite": sum(r["nonfinite"] for r in instances),
                "own_max_rel": top["own_max_rel"],
                "own_op": top["own_op"],
                "made_max_rel": made,
                "flagged": bool(reason),
                "reason": reason,
            }
        )
    return rows


def in_force_or_default():
    """The Conversion in force, or the one a plain ``hmp.convert()`` makes."""
    return in_force() or plan(Requested())


def kind_of(name, lists):  # the public name of the list (of ``lists``, by kinds.Kind) holding ``name``
    return next((k.name for k in kinds.KINDS if name in lists[k]), None)


def run_step(
    fn,
    args,
    kwargs,
    guard,
    conversion=None,
    passthrough=False,
    keep_outputs=False,
    restore_dtype=False,
    forced=None,
    module_outputs=False,
    cast_only_in=None,
):
    """One run of ``fn`` from the guarded state under ``conversion`` (None:
    plain torch), recorded (see record.Recorder for the options), with the
    guarded modules hooked when outputs are kept (and, with ``cast_only_in``,
    a record.Confinement around those modules); the configuration in force is
    back afterwards."""
    recorder = Recorder(keep_outputs, restore_dtype, forced, module_outputs, cast_only_in)
    paths = module_paths(guard.modules) if keep_outputs else {}
    boundary = Confinement(paths, cast_only_in or ())
    with (
        guard.running(),
        applied(conversion, recorder=recorder, passthrough=passthrough),
        ModuleHooks(recorder, paths),
        boundary,
    ):
        value = fn(*args, **kwargs)
    return _final(value, guard.tool), recorder


def made_in(fn, args, kwargs, guard, conversion, ref, inside):
    """The errors of the modules at ``inside`` (paths) made by their own code:
    ``{path: (max_rel, mean_rel, nonfinite)}`` of their outputs against the
    fp32 run ``ref``, from a run in which only ops called directly in them
    cast, and only what they round leaves them (record.Confinement)."""
    _, run = run_step(
        fn, args, kwargs, guard, conversion, keep_outputs=True, module_outputs=True, cast_only_in=set(inside)
    )
    ref_outputs, got = by_op(ref.module_outputs), by_op(run.module_outputs)
    return {path: worst(pairs(ref_outputs, got, path)) for path in inside if path in got}


def made_by_class(fn, args, kwargs, guard, conversion, ref, full, runs=None):
    """made_in() for the modules in which the run ``full`` called an op that
    casts, one run per module class: ``{path: (max_rel, mean_rel, nonfinite)}``."""
    paths = module_paths(guard.modules)
    casting = {name for name, stats in full.stats.items() if stats.casts}
    by_class = {}
    for path in dict.fromkeys(o.module for o in full.outputs if o.name in casting and o.module is not None):
        by_class.setdefault(type(paths[path]), []).append(path)
    (runs or QUIET).expect(len(by_class), "audit: each module class's own error")
    made = {}
    for inside in by_class.values():
        made.update(made_in(fn, args, kwargs, guard, conversion, ref, inside))
    return made


def audit(
    fn: Step,
    *args: Any,
    state: Iterable[object] = (),
    threshold: float = 0.05,
    loss_threshold: float = 2e-3,
    progress: Callable[[int, int, str], None] | bool | None = None,
    **kwargs: Any,
) -> AuditReport:
    """Compare ``fn(*args, **kwargs)`` in fp32 and under hmp, op by op.

    ``fn`` returns its loss (loss.step_loss: a tensor, a number, a dict with
    "loss", an object with .loss). ``state``: the modules, optimizers,
    schedulers and tensors ``fn`` changes (those among the arguments are
    found by themselves); everything guard.StateGuard saves is as before
    after the audit, also when ``fn`` raises, and what it cannot put back
    is refused. An op is flagged when its own bf16 error
    (measured with only it cast) exceeds ``threshold``, when it introduces
    inf/NaN, or when the error it alone passes on to ``fn``'s output exceeds
    ``loss_threshold``. The modules among ``state`` and the arguments get
    rows too (``report.modules``, ``report.module_classes``): their outputs'
    error, the error their own code makes (made_in()), and the largest own
    error of an op called directly in them; a class is flagged when either
    of the last two exceeds ``threshold``. The configuration in force before
    is restored. ``progress``: None shows the runs of ``fn`` as a bar on
    stderr once the audit takes more than a few seconds (progress.StepRuns);
    False shows nothing; a callable is called as ``progress(done, total,
    what)`` after each run.
    """
    guard = StateGuard("hmp.audit", state, args, kwargs, fn)
    runs = StepRuns("hmp.audit", progress)
    report = None
    try:
        report = audit_with(guard, runs.counted(fn), args, kwargs, threshold, loss_threshold, runs)
        return report
    finally:
        guard.restore()
        runs.close(None if report is None else f"audited in {runs.done} runs of the step")


def audit_with(guard, fn, args, kwargs, threshold, loss_threshold, runs=None):
    """audit() from the state ``guard`` holds (tune shares its guard);
    ``runs`` (progress.StepRuns, counting ``fn``'s calls) is told how many
    runs each phase makes."""
    runs = runs or QUIET
    conversion = in_force_or_default()
    decided = decisions(conversion)  # an entry that does not cast binds nothing: in no list's rule
    lists = {k: {n for n, why in entries.items() if why == CAST} for k, entries in decided.items()}
    runs.expect(2, "audit: a step in fp32 and under the lists")
    ref_final, ref = run_step(
        fn, args, kwargs, guard, conversion, passthrough=True, keep_outputs=True, module_outputs=True
    )
    hmp_final, full = run_step(fn, args, kwargs, guard, conversion, keep_outputs=True, module_outputs=True)
    output_error = compare(ref_final, hmp_final)[0]
    by_op_ref, by_op_hmp = by_op(ref.outputs), by_op(full.outputs)
    runs.expect(sum(1 for stats in full.stats.values() if stats.casts), "audit: each op cast alone")
    rows = []
    for name, stats in full.stats.items():
        max_rel, mean_rel, nonfinite = worst(pairs(by_op_ref, by_op_hmp, name))
        row = {
            "op": name,
            "list": kind_of(name, lists),
            "ran_in": ran_in(stats),
            "calls": stats.calls,
            "casts": stats.casts,
            "max_rel": max_rel,
            "mean_rel": mean_rel,
            "nonfinite": nonfinite,
            "own_max_rel": 0.0,
            "loss_error": 0.0,
            "own_by_module": {},
        }
        if stats.casts:
            only = {k: ({name} if name in lists[k] else set()) for k in kinds.KINDS}
            own_final, own = run_step(
                fn, args, kwargs, guard, conversion._replace(lists=only), keep_outputs=True, restore_dtype=True
            )
            own_pairs = pairs(by_op_ref, by_op(own.outputs), name)
            row["own_max_rel"], _, own_nonfinite = worst(own_pairs)
            row["own_by_module"] = worst_by_module(own_pairs)
            if row["own_max_rel"] > threshold and len(row["own_by_module"]) > 1:
                # which module's calls introduce it: once more, each call from the fp32 run's
                # inputs, so the error of the op's earlier calls does not count in later ones
                runs.expect(1)
                _, forced = run_step(
                    fn,
                    args,
                    kwargs,
                    guard,
                    conversion._replace(lists=only),
                    keep_outputs=True,
                    restore_dtype=True,
                    forced=by_op_ref,
                )
                row["own_by_module"] = worst_by_module(pairs(by_op_ref, by_op(forced.outputs), name))
            row["nonfinite"] = max(nonfinite, own_nonfinite)
            row["loss_error"], _, final_nonfinite = compare(ref_final, own_final)
            row["nonfinite"] += final_nonfinite
        _flag(row, threshold, loss_threshold)
        rows.append(row)
    made = made_by_class(fn, args, kwargs, guard, conversion, ref, full, runs)
    runs.expect(3 * (TIMED_PAIRS + 1), "audit: timing the ops (in fp32, and twice under the lists: the control)")
    walls, device = {}, host.device_of(guard.modules)  # walls: the steps the op times are parts of
    run = lambda fp32: run_step(fn, args, kwargs, guard, conversion, passthrough=fp32)[1].stats  # noqa: E731
    times, total = op_times(run, walls=walls, device=device)
    for row in rows:
        row.update(times.get(row["op"], NOT_TIMED))
    paths = module_paths(guard.modules)
    modules = _module_rows(paths, ref, full, rows, made)
    seen = {}
    for path, value in full.seen.items():
        cls = user_name(type(paths[path]))
        seen[cls] = max(seen.get(cls, value), value)
    report = AuditReport(rows, output_error, threshold, loss_threshold, modules, seen, total, _uncast(decided))
    report.step_ms = walls
    return report


def _flag(row, threshold, loss_threshold):
    """Say in ``row`` why the op is flagged, if it is."""
    reasons = []
    if row["own_max_rel"] > threshold:
        reasons.append(f"error {row['own_max_rel']:.2g} > {threshold:g}")
    if row["nonfinite"]:
        reasons.append("introduces inf/NaN")
    if row["loss_error"] > loss_threshold:
        reasons.append(f"loss error {row['loss_error']:.2g} > {loss_threshold:g}")
    row["reason"] = "; ".join(reasons)
    row["flagged"] = bool(reasons)


def _uncast(decided):
    """Why -> the entries (``"kind name"``) hmp does not cast, from queries.decisions."""
    uncast = {}
    for kind, entries in decided.items():
        for name, why in entries.items():
            if why != CAST:
                uncast.setdefault(why, []).append(f"{kind.name} {name}")
    return uncast


def by_op(outputs):
    """name -> innermost module path (None: outside the hooked modules) ->
    the recorded outputs (record.Output), in call order."""
    out = {}
    for o in outputs:
        out.setdefault(o.name, {}).setdefault(o.module, []).append(o.value)
    return out


def pairs(ref, got, name):
    """``[(module path, ref output, got output)]``: the calls of ``name`` in
    two by_op() results, paired by order within each innermost module (so
    calls one run does not record, inside an FP32 module, shift no others)."""
    mine = got.get(name, {})
    return [(m, r, g) for m, values in ref.get(name, {}).items() for r, g in zip(values, mine.get(m, ()))]


def worst(calls):
    """The largest errors over ``calls`` (from pairs()), and their inf/NaN count."""
    max_rel = mean_rel = 0.0
    nonfinite = 0
    for _, ref, got in calls:
        a, b, c = compare(ref, got)
        max_rel, mean_rel, nonfinite = max(max_rel, a), max(mean_rel, b), nonfinite + c
    return max_rel, mean_rel, nonfinite


def worst_by_module(calls):
    """module path -> the largest max relative error of ``calls`` made directly in it."""
    out = {}
    for module, ref, got in calls:
        out[module] = max(out.get(module, 0.0), compare(ref, got)[0])
    return out
