"""hmp.profile: run a function once under the current configuration and
report, per listed op, what hmp did and what it cost."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

import torch

from hmp.core.hints import Step
from hmp.driver.conversion import applied, in_force
from hmp.tools.files import write_all
from hmp.tools.guard import StateGuard
from hmp.tools.loss import step_loss
from hmp.tools.record import Recorder
from hmp.tools.report import STYLE, boxed, esc, table
from hmp.version import __version__

COLUMNS = ("op", "calls", "inputs (most common)", "ran in", "op ms", "cast ms", "casts", "MB cast")


def _top(counter):
    if not counter:
        return ""
    dtypes, _ = counter.most_common(1)[0]
    return ",".join(dtypes)


class ProfileReport:
    """Per-op statistics of one profiled run."""

    def __init__(self, stats):
        self.stats = stats  # op name -> record.OpStats

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
        """A markdown table sorted by time (op plus casting)."""
        lines = ["| " + " | ".join(COLUMNS) + " |", "|---|---:|---|---|---:|---:|---:|---:|"]
        lines += ["| " + " | ".join(map(str, cells)) + " |" for cells in self.cells()]
        return "\n".join(lines)

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
                    '<p class="caption">One row per listed op the function ran, most time first: the dtypes its inputs '
                    "came in and it ran in (most common), its forward calls, the time in the op and in hmp's casts, "
                    "and how much data was cast. One run, so small differences are noise.</p>",
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
        return json.dumps({"ops": self.rows()}, indent=2)

    def save(self, path):
        Path(path).write_text(self.to_json() + "\n")

    def __str__(self):
        return self.table()


def profile(fn: Step, *args: Any, state: Iterable[object] = (), **kwargs: Any) -> ProfileReport:
    """Run ``fn(*args, **kwargs)`` once with instrumented wrappers and return
    a ProfileReport. hmp must be converted; its configuration is restored
    afterwards, with no instrumentation left behind. ``fn`` returns its loss
    (loss.step_loss), as for audit and tune. ``state``: the modules,
    optimizers, schedulers and tensors ``fn`` changes, as for audit: they
    are put back afterwards (guard.StateGuard), also when ``fn`` raises."""
    conversion = in_force()
    if conversion is None:
        raise RuntimeError("hmp.profile: call hmp.convert() first; profile reports on the current configuration")
    guard = StateGuard("hmp.profile", state, args, kwargs, fn)
    recorder = Recorder()
    try:
        with guard.running(), applied(conversion, recorder=recorder):
            value = fn(*args, **kwargs)
        step_loss(value, "hmp.profile")
    finally:
        guard.restore()
    return ProfileReport(recorder.stats)
