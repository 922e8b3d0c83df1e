"""hmp.profile: run a function once under the current configuration and
report, per listed op, what hmp did and what it cost."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from hmp.core.conversion import applied, in_force
from hmp.core.hints import Step
from hmp.tools.guard import StateGuard
from hmp.tools.loss import step_loss
from hmp.tools.record import Recorder


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

    def table(self):
        """A markdown table sorted by time (op plus casting)."""
        lines = [
            "| op | calls | inputs (most common) | ran in | op ms | cast ms | casts | MB cast |",
            "|---|---:|---|---|---:|---:|---:|---:|",
        ]
        for r in self.rows():
            lines.append(
                f"| {r['op']} | {r['calls']} | {r['inputs']} | {r['ran_in']} | "
                f"{r['op_ms']:.3f} | {r['cast_ms']:.3f} | {r['casts']} | {r['bytes_cast'] / 1e6:.3f} |"
            )
        return "\n".join(lines)

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
