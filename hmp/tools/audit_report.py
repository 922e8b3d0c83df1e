"""What hmp.audit returns: the rows of its runs, as a table and an HTML page (auditing.py measures them)."""

from datetime import datetime, timezone

from hmp.tools import speed
from hmp.tools.report.page import write as write_html
from hmp.tools.target import user_name

TOP = 10  # module rows table() shows; all are in AuditReport.modules / .module_classes


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
            f"listed ops' forward time under the lists: {speed.words(self.time_ratio)}",
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
