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

from typing import Any, Callable, Iterable

from hmp.binding import kinds
from hmp.binding.pays import CAST
from hmp.core.hints import Step
from hmp.driver.conversion import applied
from hmp.driver.plan import Requested, plan
from hmp.driver.queries import decisions, in_force
from hmp.tools import host
from hmp.tools.audit_report import AuditReport
from hmp.tools.guard import StateGuard
from hmp.tools.loss import step_loss
from hmp.tools.op_costs import NOT_TIMED, TIMED_PAIRS, op_times
from hmp.tools.output_errors import by_op, compare, pairs, worst, worst_by_module
from hmp.tools.progress import StepRuns
from hmp.tools.record import Confinement, ModuleHooks, Recorder, module_paths, ran_in
from hmp.tools.target import user_name

QUIET = StepRuns("", False)  # counts nothing anyone sees: audit_with() called without a counter


def _final(value, tool):
    """What a run's errors are measured on: the step's loss (loss.step_loss)."""
    return (step_loss(value, tool).detach().clone(),)


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
    step = (fn, args, kwargs, guard)
    rows = []
    for name, stats in full.stats.items():
        row = _op_row(step, conversion, lists, name, stats, (ref_final, by_op_ref, by_op_hmp), threshold, runs)
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


def _op_row(step, conversion, lists, name, stats, fp32_and_lists, threshold, runs):
    """One op's row: its outputs' error under the lists against fp32 and, where it casts, a run with only
    it cast: its own error, where each call was made (a module whose calls introduce it), and the error it
    alone passes on to the loss. ``fp32_and_lists``: the fp32 run's loss, both runs' outputs by op."""
    fn, args, kwargs, guard = step
    ref_final, by_op_ref, by_op_hmp = fp32_and_lists
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
    if not stats.casts:
        return row
    only = conversion._replace(lists={k: ({name} if name in lists[k] else set()) for k in kinds.KINDS})
    own_final, own = run_step(fn, args, kwargs, guard, only, keep_outputs=True, restore_dtype=True)
    own_pairs = pairs(by_op_ref, by_op(own.outputs), name)
    row["own_max_rel"], _, own_nonfinite = worst(own_pairs)
    row["own_by_module"] = worst_by_module(own_pairs)
    if row["own_max_rel"] > threshold and len(row["own_by_module"]) > 1:
        # which module's calls introduce it: once more, each call from the fp32 run's
        # inputs, so the error of the op's earlier calls does not count in later ones
        runs.expect(1)
        _, forced = run_step(fn, args, kwargs, guard, only, keep_outputs=True, restore_dtype=True, forced=by_op_ref)
        row["own_by_module"] = worst_by_module(pairs(by_op_ref, by_op(forced.outputs), name))
    row["nonfinite"] = max(nonfinite, own_nonfinite)
    row["loss_error"], _, final_nonfinite = compare(ref_final, own_final)
    row["nonfinite"] += final_nonfinite
    return row


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
