"""hmp.profile: run a function under the current configuration and report,
per listed op, what hmp did and what it cost: one warm-up run, then
``repeats`` recorded runs from the same state; counts (calls, casts, bytes)
come from the first recorded run, times are each op's median over the runs,
and the page says the middle half of the runs' totals, the noise those
medians carry."""

from __future__ import annotations

import dataclasses
import json
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from hmp.core.hints import Step
from hmp.driver.conversion import applied
from hmp.driver.queries import in_force
from hmp.tools import host, speed, timing
from hmp.tools.files import write_all
from hmp.tools.guard import StateGuard
from hmp.tools.loss import step_loss
from hmp.tools.progress import StepRuns
from hmp.tools.record import Recorder
from hmp.tools.report.page import STYLE, boxed, esc, table
from hmp.tools.timing import collector_paused
from hmp.version import __version__

COLUMNS = ("op", "calls", "inputs (most common)", "ran in", "op ms", "cast ms", "casts", "MB cast")


def _top(counter):
    if not counter:
        return ""
    dtypes, _ = counter.most_common(1)[0]
    return ",".join(dtypes)


class ProfileReport:
    """Per-op statistics of the profiled runs: ``stats``, op name ->
    record.OpStats (counts from one run, times the median over the runs);
    ``totals``, per run, the listed ops' time and the cast time (seconds);
    ``under``, the lists the runs ran under, in words; ``load``, what the
    machine did while they ran (timing.Load, None: not read)."""

    def __init__(self, stats, totals=(), under="", load=None):
        self.stats = stats
        self.totals = list(totals)
        self.under, self.load = under, load

    def noise(self):
        """One line: how many runs the times are medians of, the middle half of the runs' totals, and how busy
        the machine was (speed.profile_noise)."""
        return speed.profile_noise(self.totals, self.load)

    def rows(self):
        rows = []
        for name, s in self.stats.items():
            rows.append(
                {
                    "op": name,
                    "calls": s.calls,
                    "input_dtypes": {",".join(k): v for k, v in s.input_dtypes.items()},
                    "chosen_dtypes": {",".join(k): v for k, v in s.chosen_dtypes.items()},
                    "inputs": _top(s.input_dtypes),
                    "ran_in": _top(s.chosen_dtypes),
                    "op_ms": s.op_seconds * 1e3,
                    "cast_ms": s.cast_seconds * 1e3,
                    "casts": s.casts,
                    "cast_to": dict(s.cast_to),
                    "bytes_cast": s.bytes_cast,
                }
            )
        rows.sort(key=lambda r: r["op_ms"] + r["cast_ms"], reverse=True)
        return rows

    def cells(self):
        """One list of table cells per op, sorted by time (op plus casting)."""
        return [
            [r["op"], r["calls"], r["inputs"], r["ran_in"], f"{r['op_ms']:.3f}", f"{r['cast_ms']:.3f}", r["casts"]]
            + [f"{r['bytes_cast'] / 1e6:.3f}"]
            for r in self.rows()
        ]

    def table(self):
        """A markdown table sorted by time (op plus casting), and the noise line."""
        lines = ["| " + " | ".join(COLUMNS) + " |", "|---|---:|---|---|---:|---:|---:|---:|"]
        lines += ["| " + " | ".join(map(str, cells)) + " |" for cells in self.cells()]
        return "\n".join(([self.under, ""] if self.under else []) + lines + ["", self.noise()])

    def to_html(self, title="hmp profile report"):
        """One self-contained HTML page: a summary line and the table."""
        rows = self.rows()
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        summary = (
            f"{len(rows)} listed ops, {sum(r['calls'] for r in rows)} calls: "
            f"{sum(r['op_ms'] for r in rows):.3f} ms in the ops, {sum(r['cast_ms'] for r in rows):.3f} ms casting "
            f"({sum(r['casts'] for r in rows)} casts, {sum(r['bytes_cast'] for r in rows) / 1e6:.3f} MB)"
        )
        return (
            "\n".join(
                [
                    "<!DOCTYPE html>",
                    '<html lang="en">',
                    f'<head><meta charset="utf-8"><title>{esc(title)}</title><style>{STYLE}</style></head>',
                    "<body>",
                    f"<h1>{esc(title)}</h1>",
                    f'<p class="meta">{esc(f"measured {stamp} | hmp {__version__} | torch {torch.__version__}")}</p>',
                    f"<p>{esc(summary)}</p>",
                    *([f"<p>{esc(self.under)}</p>"] if self.under else []),
                    '<p class="caption">One row per listed op the function ran, most time first: the dtypes its inputs '
                    "came in and it ran in (most common), its forward calls, the time in the op and in hmp's casts, "
                    f"and how much data was cast. {esc(self.noise().capitalize())}.</p>",
                    boxed(table(COLUMNS, self.cells(), numeric=(1, 4, 5, 6, 7))),
                    "</body>",
                    "</html>",
                    "",
                ]
            )
            .encode("ascii", "xmlcharrefreplace")
            .decode("ascii")
        )

    def save_html(self, path):
        """Write to_html() to ``path``, atomically (files.write_all)."""
        write_all([(path, self.to_html())], "hmp.profile")

    def to_json(self):
        runs = [{"op_ms": op * 1e3, "cast_ms": cast * 1e3} for op, cast in self.totals]
        return json.dumps({"under": self.under, "ops": self.rows(), "runs": runs, "noise": self.noise()}, indent=2)

    def save(self, path):
        Path(path).write_text(self.to_json() + "\n")

    def __str__(self):
        return self.table()


def profile(
    fn: Step,
    *args: Any,
    state: Iterable[object] = (),
    repeats: int = 5,
    progress: Callable[[int, int, str], None] | bool | None = None,
    **kwargs: Any,
) -> ProfileReport:
    """Run ``fn(*args, **kwargs)`` once to warm up, then ``repeats`` times
    with instrumented wrappers, each from the same state, and return a
    ProfileReport. hmp must be converted; its configuration is restored
    afterwards, with no instrumentation left behind. ``fn`` returns its loss
    (loss.step_loss), as for audit and tune. ``state``: the modules,
    optimizers, schedulers and tensors ``fn`` changes, as for audit: they
    are put back before each run and afterwards (guard.StateGuard), also
    when ``fn`` raises. ``progress``: as for hmp.audit (a bar on stderr
    when the runs take more than a few seconds; False: none)."""
    conversion = in_force()
    if conversion is None:
        raise RuntimeError("hmp.profile: call hmp.convert() first; profile reports on the current configuration")
    if not (isinstance(repeats, int) and repeats >= 1):
        raise ValueError(f"hmp.profile: repeats must be a positive integer, got {repeats!r}")
    guard = StateGuard("hmp.profile", state, args, kwargs, fn)
    runs = StepRuns("hmp.profile", progress)
    counted = runs.counted(fn)
    runs.expect(repeats + 1, "profile")
    recorded, samples = [], []
    device = host.device_of(guard.modules)
    try:
        with guard.running(), applied(conversion):
            step_loss(counted(*args, **kwargs), "hmp.profile")  # warm-up: first calls fill caches
        with collector_paused():
            for _ in range(repeats):
                recorder = Recorder()
                with guard.running(), applied(conversion, recorder=recorder):
                    value, sample = host.timed(lambda: counted(*args, **kwargs), device)
                samples.append(sample)
                step_loss(value, "hmp.profile")
                recorded.append(recorder.stats)
    finally:
        guard.restore()
        runs.close()
    busy = sum(1 for s in samples if (s.contention() or 0.0) > timing.MARGIN)
    load = timing.load_of([(s,) for s in samples], busy)
    return ProfileReport(_medians(recorded), [_total(stats) for stats in recorded], lists_in_force(conversion), load)


def lists_in_force(conversion):
    """The lists a conversion casts by, in words: ``under opt_level O1: the bf16 list (12 ops), ...``."""
    counts = ", ".join(f"the {kind.name} list ({len(ops)} ops)" for kind, ops in conversion.lists.items())
    return f"under opt_level {conversion.options.opt_level}: {counts}"


def _total(stats):
    return sum(s.op_seconds for s in stats.values()), sum(s.cast_seconds for s in stats.values())


def _medians(recorded):
    """The first run's OpStats with each op's times the median over all runs (0 in a run without it)."""
    out = {}
    for name, first in recorded[0].items():
        runs = [stats.get(name) for stats in recorded]
        out[name] = dataclasses.replace(
            first,
            op_seconds=statistics.median(s.op_seconds if s else 0.0 for s in runs),
            cast_seconds=statistics.median(s.cast_seconds if s else 0.0 for s in runs),
        )
    return out
