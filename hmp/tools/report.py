"""One self-contained HTML page for hmp.audit and hmp.tune: inline SVG bar
charts, a style sheet in the page, no scripts, no external assets.

Each chart has one row per op (or module, or op tune tried) and one column
per quantity, each column as wide as its widest text needs: labels sit in
their own column and never overlap each other or a bar. Errors are bars on
a log axis with the threshold as a dashed line; a value the axis cannot
show (0, inf, NaN, nothing measured) gets a note in its cell instead of a
bar. Text is monospace, so a label's width is its length times 0.6 em.

``render(audit=None, tune=None, title=None)`` returns the page;
``write(path, ...)`` writes it atomically.
"""

import html
import math
import os
import secrets
from datetime import datetime, timezone
from pathlib import Path

import torch

from hmp.core.lists import class_path
from hmp.tools.files import check_outputs
from hmp.version import __version__

TOOL = "hmp.tools.report"
FONT = 12  # px, row and header text
TICK_FONT = 10  # px, axis tick labels
CHAR = 0.6  # em per character of the monospace font
ROW = 20  # px per row
PAD = 8  # px around a chart
GAP = 18  # px between columns
HEAD = 58  # px above the first row: column titles, threshold labels, tick labels
TITLE_Y, MARK_Y, TICK_Y, AXIS_Y = 14, 31, 48, 54
BAR_TOP, BAR_H = 4, 12  # an error bar within its row
MIN_BAR = 2  # px: the smallest value on an axis still shows
MAX_DECADES = 8  # a log axis spans at most this many powers of ten

OK, OVER, BAD = "#4c78a8", "#f58518", "#c0392b"  # bar under the threshold, over it; inf/NaN
FP32_TIME, LOW_TIME, SLOWER = "#a3a3a3", "#54a24b", "#f58518"
OUTPUT = "#9ecae9"  # a module's output error: what reaches it, not what it makes
LIST_COLOURS = {"bf16": "#1b9e77", "fp32": "#7570b3", "promote": "#a6761d", None: "#8c8c8c"}
FONT_FAMILY = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', monospace"


def text_width(text, size=FONT):
    return len(text) * size * CHAR


def esc(value):
    return html.escape(str(value), quote=True)


def _num(value, digits=3):
    return f"{value:.{digits}g}"


# --- axes -------------------------------------------------------------------------------------------------------


def _finite_positive(v):
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def _note_for(value):
    """Why ``value`` has no bar, or None when it can have one."""
    if value is None:
        return "not measured"
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value < 0:
        return f"negative ({_num(value)})"
    if value == 0:
        return "0"
    return None


class LogAxis:
    """A log axis of ``width`` px over whole powers of ten covering the
    finite positive ``values`` and ``marks`` (thresholds), at most
    MAX_DECADES of them (the largest kept)."""

    def __init__(self, values, width, marks=()):
        found = [float(v) for v in (*values, *marks) if _finite_positive(v)]
        if found:
            lo, hi = math.floor(math.log10(min(found))), math.ceil(math.log10(max(found)))
        else:
            lo, hi = -4, 0
        hi = max(hi, lo + 1)
        self.lo, self.hi, self.width = max(lo, hi - MAX_DECADES), hi, float(width)

    def at(self, value):
        """Offset of ``value`` (finite, positive) from the axis start, clipped to it."""
        t = (math.log10(value) - self.lo) / (self.hi - self.lo)
        return min(max(t, 0.0), 1.0) * self.width

    def bar(self, value):
        """``(length, note)``: a bar's length in px for ``value``, and the
        note shown instead when it has no bar (0, inf, NaN, None, below the
        axis)."""
        note = _note_for(value)
        if note is not None:
            return 0.0, note
        if math.log10(value) < self.lo:
            return 0.0, f"below {10.0**self.lo:g}"
        return max(self.at(value), MIN_BAR), None

    def ticks(self):
        """``[(value, offset, label)]``: powers of ten, every ``step``-th so labels keep apart."""
        decades = list(range(self.lo, self.hi + 1))
        widest = max(text_width(f"{10.0**k:g}", TICK_FONT) for k in decades)
        spacing = self.width / (self.hi - self.lo)
        step = max(1, math.ceil((widest + 6) / spacing))
        return [(10.0**k, self.at(10.0**k), f"{10.0**k:g}") for k in decades[::-1][::step][::-1]]

    def widest_tick(self):
        return max(text_width(label, TICK_FONT) for _, _, label in self.ticks())


class LinearAxis:
    """A linear axis from 0 of ``width`` px, ending at a round number at or above the largest value."""

    def __init__(self, values, width):
        top = max((float(v) for v in values if _finite_positive(v)), default=1.0)
        self.step = _round_step(top / 4)
        self.hi = self.step * math.ceil(top / self.step - 1e-9)
        self.width = float(width)

    def at(self, value):
        return min(max(value / self.hi, 0.0), 1.0) * self.width

    def bar(self, value):
        note = _note_for(value)
        if note == "0":
            return 0.0, None  # no time: no bar, nothing to say
        if note is not None:
            return 0.0, note
        return max(self.at(value), MIN_BAR), None

    def ticks(self):
        n = int(round(self.hi / self.step))
        widest = max(text_width(f"{self.step * i:g}", TICK_FONT) for i in range(n + 1))
        every = max(1, math.ceil((widest + 6) / (self.width / n)))
        return [(self.step * i, self.at(self.step * i), f"{self.step * i:g}") for i in range(0, n + 1, every)]

    def widest_tick(self):
        return max(text_width(label, TICK_FONT) for _, _, label in self.ticks())


def _round_step(x):
    """The smallest of 1, 2, 5 times a power of ten at or above ``x``."""
    k = math.floor(math.log10(x))
    for m in (1, 2, 5, 10):
        if m * 10.0**k >= x * (1 - 1e-9):
            return m * 10.0**k
    return 10.0 ** (k + 1)


# --- SVG pieces ---------------------------------------------------------------------------------------------------


def _text(x, y, text, cls, anchor="start", size=FONT, fill=None, weight=None):
    extra = f' fill="{fill}"' if fill else ""
    extra += f' font-weight="{weight}"' if weight else ""
    return (
        f'<text class="{cls}" x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{extra}>'
        f"{esc(text)}</text>"
    )


def _rect(x, y, w, h, cls, fill, extra=""):
    return f'<rect class="{cls}" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}"{extra}/>'


def _line(x1, y1, x2, y2, cls, stroke, extra=""):
    return f'<line class="{cls}" x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{stroke}"{extra}/>'


def _baseline(top):
    return top + ROW * 0.7


# --- columns ------------------------------------------------------------------------------------------------------


class Column:
    """One column of a chart: a title, a width, and what each row shows in it."""

    title = ""
    width = 0.0

    def header(self, x):
        return []

    def overlay(self, x, top, bottom):
        return []

    def cell(self, row, x, top):
        return []


class TextColumn(Column):
    """Text per row (``get(row)`` -> text, or (text, colour)); ``cls`` "label" for the rows' names."""

    def __init__(self, title, rows, get, cls="text", weight=None):
        self.title, self.get, self.cls, self.weight = title, get, cls, weight
        texts = [self._value(r)[0] for r in rows]
        self.width = max([text_width(title)] + [text_width(t) for t in texts])

    def _value(self, row):
        value = self.get(row)
        return value if isinstance(value, tuple) else (value, None)

    def cell(self, row, x, top):
        text, colour = self._value(row)
        return [_text(x, _baseline(top), text, self.cls, fill=colour, weight=self.weight)] if text else []


class BadgeColumn(Column):
    """A coloured marker with a word per row (which list an op is in)."""

    def __init__(self, title, rows, get):
        self.title, self.get = title, get
        self.inner = max([text_width(self.get(r)[0]) for r in rows] + [0]) + 8
        self.width = max(text_width(title), self.inner)

    def cell(self, row, x, top):
        word, colour = self.get(row)
        return [
            _rect(x, top + 3, self.inner, ROW - 6, "badge", colour, ' rx="3"'),
            _text(x + self.inner / 2, _baseline(top), word, "badge-text", anchor="middle", fill="#ffffff"),
        ]


class BarColumn(Column):
    """A bar per row on a shared axis, the value as text after the plot,
    a note instead of the bar when there is none, and optional marks
    (thresholds) as dashed lines through all rows."""

    def __init__(self, title, rows, get, axis, marks=(), colour=None, fmt=_num, notes=None):
        # get(row) -> value; colour(row, value) -> fill; notes(row, value) -> a note overriding the axis' own
        self.title, self.get, self.axis, self.marks = title, get, axis, list(marks)
        self.colour = colour or (lambda row, value: OK)
        self.fmt, self.notes = fmt, notes or (lambda row, value: None)
        self.inset = axis.widest_tick() / 2 + 2  # the first tick label stays in the column
        values = [self._shown(r) for r in rows]
        value_w = max([text_width(v) for v, _ in values if v] + [axis.widest_tick() / 2]) + 6
        note_w = max([text_width(n) for _, n in values if n] + [0]) + 4
        mark_w = max([text_width(label) for _, label in self.marks] + [0])
        self.value_x = self.inset + axis.width + 6
        self.width = max(text_width(title), self.value_x + value_w, self.inset + note_w, mark_w)

    def _shown(self, row):
        """(value text, note text) of ``row``."""
        value = self.get(row)
        note = self.notes(row, value)
        if note is None:
            length, note = self.axis.bar(value)
        return (None, note) if note is not None else (self.fmt(value), None)

    def header(self, x):
        out = []
        for value, offset, label in self.axis.ticks():
            out.append(
                f'<g class="tick" data-value="{value:g}">'
                + _text(x + self.inset + offset, TICK_Y, label, "tick-label", anchor="middle", size=TICK_FONT)
                + "</g>"
            )
        for value, label in self.marks:
            # the label centred on its line, kept within the column
            w = text_width(label)
            centre = x + self.inset + self.axis.at(value)
            left = min(max(centre - w / 2, x), x + self.width - w)
            out.append(_text(left, MARK_Y, label, "mark-label", fill=BAD))
        return out

    def overlay(self, x, top, bottom):
        x0 = x + self.inset
        out = [_line(x0 + offset, AXIS_Y, x0 + offset, bottom, "grid", "#e3e3e3") for _, offset, _ in self.axis.ticks()]
        out.append(_line(x0, AXIS_Y, x0 + self.axis.width, AXIS_Y, "axis", "#666666"))
        for value, _ in self.marks:
            at = x0 + self.axis.at(value)
            out.append(
                _line(
                    at,
                    AXIS_Y,
                    at,
                    bottom,
                    "threshold",
                    BAD,
                    f' stroke-dasharray="5,3" stroke-width="1.5" data-value="{value:g}"',
                )
            )
        return out

    def cell(self, row, x, top):
        value = self.get(row)
        text, note = self._shown(row)
        x0 = x + self.inset
        if note is not None:
            return [_text(x0 + 2, _baseline(top), note, "note", fill="#555555")]
        length, _ = self.axis.bar(value)
        return [
            _rect(x0, top + BAR_TOP, length, BAR_H, "bar", self.colour(row, value), f' data-value="{value:g}"'),
            _text(x + self.value_x, _baseline(top), text, "value"),
        ]


class TimeColumn(Column):
    """fp32 time and time under the lists, two thin bars per row on one
    linear axis, "fp32 -> lists ms" after the plot; "not measured" when
    there is no fp32 time."""

    def __init__(self, title, rows, fp32, low, width=150):
        self.title, self.fp32, self.low = title, fp32, low
        self.axis = LinearAxis([fp32(r) for r in rows] + [low(r) for r in rows], width)
        self.inset = self.axis.widest_tick() / 2 + 2
        texts = [self._label(r) for r in rows]
        self.value_x = self.inset + self.axis.width + 6
        self.width = max(text_width(title), self.value_x + max([text_width(t) for t in texts] + [0]) + 4)

    def _label(self, row):
        a, b = self.fp32(row), self.low(row)
        if a is None:
            return "not measured"
        return f"{a:.3g} ms" if b is None else f"{a:.3g} -> {b:.3g} ms"

    def header(self, x):
        return [
            f'<g class="tick" data-value="{value:g}">'
            + _text(x + self.inset + offset, TICK_Y, label, "tick-label", anchor="middle", size=TICK_FONT)
            + "</g>"
            for value, offset, label in self.axis.ticks()
        ]

    def overlay(self, x, top, bottom):
        x0 = x + self.inset
        out = [_line(x0 + offset, AXIS_Y, x0 + offset, bottom, "grid", "#e3e3e3") for _, offset, _ in self.axis.ticks()]
        return out + [_line(x0, AXIS_Y, x0 + self.axis.width, AXIS_Y, "axis", "#666666")]

    def cell(self, row, x, top):
        a, b = self.fp32(row), self.low(row)
        x0 = x + self.inset
        if a is None:
            return [_text(x0 + 2, _baseline(top), "not measured", "note", fill="#555555")]
        out = []
        length, _ = self.axis.bar(a)
        if length:
            out.append(_rect(x0, top + 3, length, 6, "bar time-fp32", FP32_TIME, f' data-value="{a:g}"'))
        if b is not None:
            length, _ = self.axis.bar(b)
            if length:
                fill = SLOWER if b > a else LOW_TIME
                out.append(_rect(x0, top + 11, length, 6, "bar time-low", fill, f' data-value="{b:g}"'))
        out.append(_text(x + self.value_x, _baseline(top), self._label(row), "value"))
        return out


def chart(rows, columns, describe=None, name="chart"):
    """An SVG of one row per item of ``rows``; ``describe(row)``: its tooltip."""
    xs, x = [], PAD
    for column in columns:
        xs.append(x)
        x += column.width + GAP
    width = math.ceil(x - GAP + PAD)
    bottom = HEAD + ROW * len(rows)
    height = bottom + PAD
    out = [
        f'<svg class="{esc(name)}" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'font-family="{esc(FONT_FAMILY)}" role="img">'
    ]
    for i in range(len(rows)):
        if i % 2:
            out.append(_rect(0, HEAD + ROW * i, width, ROW, "stripe", "#f6f6f6"))
    for column, cx in zip(columns, xs):
        out.append(f'<g class="column" data-title="{esc(column.title)}">')
        out.append(_text(cx, TITLE_Y, column.title, "head", weight="bold"))
        out += column.header(cx)
        out += column.overlay(cx, HEAD, bottom)
        out.append("</g>")
    for i, row in enumerate(rows):
        top = HEAD + ROW * i
        out.append("<g>" + (f"<title>{esc(describe(row))}</title>" if describe else ""))
        for column, cx in zip(columns, xs):
            out += column.cell(row, cx, top)
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


# --- the charts -----------------------------------------------------------------------------------------------------


def _sort_key(value):
    """Largest first; inf and NaN before everything (they need attention most)."""
    if value is None:
        return 1.0
    if math.isnan(value) or math.isinf(value):
        return -math.inf
    return -value


def _list_badge(kind):
    return (kind or "none", LIST_COLOURS.get(kind, LIST_COLOURS[None]))


def _error_colour(threshold):
    def colour(row, value):
        if not math.isfinite(value):
            return BAD
        return OVER if threshold is not None and value > threshold else OK

    return colour


def _error_column(title, rows, key, axis, threshold, notes=None, mark="threshold"):
    """The bars of the error ``row[key]``, coloured against ``threshold`` and
    with it drawn as a dashed line named ``mark``."""
    return BarColumn(
        title,
        rows,
        lambda r: r[key],
        axis,
        [(threshold, f"{mark} {threshold:g}")],
        _error_colour(threshold),
        notes=notes,
    )


def _no_own_error(row, value):
    """Why an op measured no own error: its inputs arrive in its dtype, or it runs in fp32."""
    if value != 0:
        return None
    if row.get("casts", 1) == 0:
        return "casts nothing: no own error"
    return "runs in fp32: no own error" if row.get("list") == "fp32" else None


def op_chart(audit, tune=None):
    rows = sorted(audit.rows, key=lambda r: (_sort_key(r["own_max_rel"]), _sort_key(r["loss_error"]), r["op"]))
    if not rows:
        return '<p class="empty">No listed op ran in the step.</p>'
    threshold, loss_threshold = audit.threshold, audit.loss_threshold
    own = LogAxis([r["own_max_rel"] for r in rows], 240, [threshold])
    loss = LogAxis([r["loss_error"] for r in rows], 200, [loss_threshold])
    verdict = _op_verdict(tune)
    columns = [
        TextColumn("op", rows, lambda r: r["op"], cls="label"),
        BadgeColumn("list", rows, lambda r: _list_badge(r["list"])),
        _error_column("own max rel error (only this op cast)", rows, "own_max_rel", own, threshold, _no_own_error),
        _error_column(
            "error it passes to the loss", rows, "loss_error", loss, loss_threshold, _no_own_error, "loss threshold"
        ),
        TimeColumn(
            "forward ms in one step: fp32 -> lists", rows, lambda r: r.get("fp32_ms"), lambda r: r.get("lists_ms")
        ),
        TextColumn("verdict", rows, verdict),
    ]

    def describe(r):
        return (
            f"{r['op']}: {r['calls']} calls, {r['casts']} tensors cast, output max rel error {_num(r['max_rel'])}, "
            f"mean {_num(r['mean_rel'])}, inf/NaN introduced {r['nonfinite']}"
            + ("" if r.get("cast_ms") is None else f", casts {_num(r['cast_ms'])} ms")
        )

    return chart(rows, columns, describe, "ops")


def _op_verdict(tune):
    moved = set(tune.moved_to_fp32) if tune is not None else set()
    added = set(tune.added_to_bf16) if tune is not None else set()
    proposals = tune.proposals if tune is not None else {}
    trials = tune.trials if tune is not None else {}

    def verdict(row):
        op = row["op"]
        parts = []
        if row["nonfinite"]:
            parts.append(f"introduces inf/NaN ({row['nonfinite']})")
        if op in proposals and proposals[op]["accepted"]:
            return (f"flagged; kept, {proposals[op]['class']} to FP32 instead", OVER)
        if op in moved:
            return ("moved to FP32: " + (row["reason"] or "flagged"), OVER)
        if op in added:
            return ("tried in bf16: added to BF16", LOW_TIME)
        if row["flagged"]:
            return ("flagged: " + row["reason"], OVER)
        if op in trials:
            parts.append("tried in bf16: not kept")
        return ("; ".join(parts), BAD if row["nonfinite"] else None) if parts else ("ok", "#555555")

    return verdict


def module_chart(audit, tune=None):
    rows = sorted(audit.modules, key=lambda r: (_sort_key(r["made_max_rel"]), _sort_key(r["max_rel"]), r["path"]))
    if not rows:
        return '<p class="empty">No module among the step\'s state and arguments ran.</p>'
    axis = LogAxis([r["made_max_rel"] for r in rows] + [r["max_rel"] for r in rows], 220, [audit.threshold])
    flagged = {r["class"]: r["reason"] for r in audit.module_classes if r["flagged"]}
    to_fp32 = (
        {p["class"] for p in (*tune.proposals.values(), *tune.module_proposals.values()) if p["accepted"]}
        if tune is not None
        else set()
    )

    def nothing_cast(row, value):
        return "nothing cast in it" if value == 0 and row["own_op"] is None else None

    def marker(row):
        if row["class"] in to_fp32:
            return ("class to FP32", OVER)
        if row["class"] in flagged:
            return ("class flagged: " + flagged[row["class"]], OVER)
        return ("", None)

    columns = [
        TextColumn("module", rows, lambda r: r["path"] or "(root)", cls="label"),
        TextColumn("class", rows, lambda r: r["class"].rsplit(".", 1)[-1]),
        _error_column("error made in it", rows, "made_max_rel", axis, audit.threshold, nothing_cast),
        BarColumn(
            "output max rel error (with its inputs')",
            rows,
            lambda r: r["max_rel"],
            axis,
            colour=lambda row, value: OUTPUT if math.isfinite(value) else BAD,
        ),
        TextColumn(
            "largest own op error in it",
            rows,
            lambda r: f"{_num(r['own_max_rel'])} ({r['own_op']})" if r["own_op"] else "",
        ),
        TextColumn("flagged", rows, marker),
    ]

    def describe(r):
        return (
            f"{r['path'] or '(root)'}: {r['class']}, {r['calls']} calls, output max rel error {_num(r['max_rel'])}, "
            f"mean {_num(r['mean_rel'])}, error made in it {_num(r['made_max_rel'])}"
        )

    return chart(rows, columns, describe, "modules")


def trial_chart(tune):
    rows = [dict(t, op=op) for op, t in tune.trials.items()]
    rows.sort(key=lambda r: (_sort_key(r["seconds"]), r["op"]))
    if not rows:
        return '<p class="empty">No op was tried in bf16: none left in fp32 took a large enough share of the step.</p>'
    threshold, loss_threshold = tune.audit.threshold, tune.audit.loss_threshold
    own = LogAxis([r["own_max_rel"] for r in rows], 220, [threshold])
    loss = LogAxis([r["loss_error"] for r in rows], 200, [loss_threshold])

    def outcome(r):
        if r["accepted"]:
            return ("kept in BF16", LOW_TIME)
        why = []
        if not r["own_max_rel"] <= threshold:
            why.append(f"error {_num(r['own_max_rel'], 2)} > {threshold:g}")
        if not r["loss_error"] <= loss_threshold:
            why.append(f"loss error {_num(r['loss_error'], 2)} > {loss_threshold:g}")
        if r["nonfinite"]:
            why.append("inf/NaN")
        return (
            "not kept: " + "; ".join(why)
            if why
            else "not kept (within bounds: did not cast, or dropped when the tuned lists failed validation)",
            OVER,
        )

    columns = [
        TextColumn("op tried in bf16", rows, lambda r: r["op"], cls="label"),
        BadgeColumn("was in", rows, lambda r: _list_badge(r["was"])),
        _error_column("own max rel error in bf16", rows, "own_max_rel", own, threshold),
        _error_column("error it passes to the loss", rows, "loss_error", loss, loss_threshold, mark="loss threshold"),
        TimeColumn("fp32 time in one step", rows, lambda r: r["seconds"] * 1e3, lambda r: None),
        TextColumn("outcome", rows, outcome),
    ]
    return chart(rows, columns, lambda r: f"{r['op']}: inf/NaN {r['nonfinite']}", "trials")


# --- tables ---------------------------------------------------------------------------------------------------------


def table(headers, rows, numeric=()):
    out = ["<table>", "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in headers) + "</tr>"]
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            cls = ' class="num"' if i in numeric else ""
            cells.append(f"<td{cls}>{esc(cell)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def validation_table(tune):
    """The validation rows from the TuneResult's own measures (loss_gap,
    spread, same_as), each row's verdict against its tolerance."""
    timings = tune.timings
    fp32_ms = timings.get("fp32")
    rows = []
    for name, value in tune.validation.items():
        ms, noise = timings.get(name), tune.spread(name)
        label = name + (f" (same lists as {tune.same_as[name]})" if name in tune.same_as else "")
        rel = "" if name == "fp32" else f"{tune.loss_gap(name):+.2%}"
        speed = "" if ms is None or not fp32_ms else f"{fp32_ms / ms:.2f}x"
        rows.append(
            [
                label,
                f"{value:.5f}",
                rel,
                "" if ms is None else f"{ms * 1e3:.2f}",
                "" if noise is None else f"+-{noise / 2:.0%}",
                speed,
                _validation_verdict(tune, name),
            ]
        )
    return table(
        ["lists", "final loss", "vs fp32's loss", "step ms (median)", "spread", "speed vs fp32", "verdict"],
        rows,
        numeric=(1, 2, 3, 4, 5),
    )


def _validation_verdict(tune, name):
    if name == "fp32":
        return "reference"
    if not (math.isfinite(tune.validation[name]) and math.isfinite(tune.validation["fp32"])):
        return "diverged"
    gap = abs(tune.loss_gap(name))
    if name != "tuned lists":
        return ""
    if gap <= tune.tolerance:
        return f"within tolerance ({tune.tolerance:.0%} of fp32's loss)"
    if gap <= abs(tune.loss_gap("starting lists")):
        return f"outside tolerance ({tune.tolerance:.0%}), but no further than the starting lists"
    return f"outside tolerance ({tune.tolerance:.0%})"


# --- the page -------------------------------------------------------------------------------------------------------

STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; margin-bottom: 4px; } h2 { font-size: 16px; margin-top: 28px; }
p.meta { color: #555; margin-top: 0; } p.caption { color: #444; max-width: 70em; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; } td.num { text-align: right; }
ul.legend { list-style: none; padding: 0; display: flex; flex-wrap: wrap; gap: 6px 18px; font-size: 13px; }
ul.legend svg { vertical-align: middle; margin-right: 4px; }
svg text.note { paint-order: stroke; stroke: #ffffff; stroke-width: 3px; }
dl.summary { display: grid; grid-template-columns: max-content auto; gap: 2px 12px; font-size: 14px; }
dl.summary dt { color: #555; } dl.summary dd { margin: 0; }
"""


def _swatch(shape):
    return f'<svg width="22" height="12" viewBox="0 0 22 12">{shape}</svg>'


def legend(tune=None):
    items = [
        (_rect(1, 2, 20, 8, "swatch", OK), "error under the threshold"),
        (_rect(1, 2, 20, 8, "swatch", OVER), "error over the threshold"),
        (_line(11, 0, 11, 12, "swatch", BAD, ' stroke-dasharray="3,2" stroke-width="1.5"'), "threshold"),
        (_rect(1, 2, 20, 8, "swatch", BAD), "inf/NaN"),
        (_rect(1, 2, 20, 8, "swatch", OUTPUT), "a module's output error (with what its inputs carry)"),
        (
            _rect(1, 1, 20, 4, "swatch", FP32_TIME) + _rect(1, 7, 12, 4, "swatch", LOW_TIME),
            "time in fp32 (grey) and under the lists (green; orange when slower)",
        ),
    ]
    items += [
        (_rect(1, 1, 20, 10, "swatch", colour, ' rx="2"'), f"in the {kind.upper()} list" if kind else "in no list")
        for kind, colour in LIST_COLOURS.items()
    ]
    return '<ul class="legend">' + "".join(f"<li>{_swatch(shape)}{esc(label)}</li>" for shape, label in items) + "</ul>"


def _summary(items):
    return '<dl class="summary">' + "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in items) + "</dl>"


def _timed_total(rows):
    both = [r for r in rows if r.get("fp32_ms") is not None and r.get("lists_ms") is not None]
    if not both:
        return "not measured"
    fp32, low = sum(r["fp32_ms"] for r in both), sum(r["lists_ms"] for r in both)
    casts = sum(r.get("cast_ms") or 0.0 for r in both)
    return f"{fp32:.3g} ms in fp32, {low:.3g} ms under the lists (casts {casts:.3g} ms of it), {len(both)} ops"


def render(audit=None, tune=None, title=None):
    """The HTML page for an audit report and/or a tune result (whose audit
    is used when ``audit`` is not given)."""
    if audit is None and tune is None:
        raise ValueError(f"{TOOL}: give an audit report (hmp.audit's) or a tune result (hmp.tune's)")
    if audit is None:
        audit = tune.audit
    created = getattr(audit, "created", None) or datetime.now(timezone.utc)
    tool = "tune" if tune is not None else "audit"
    title = title or f"hmp {tool} report"
    meta = [
        f"measured {created.strftime('%Y-%m-%d %H:%M UTC')}",
        f"torch {torch.__version__}",
        f"threshold {audit.threshold:g} (an op's own error, error made in a module)",
        f"loss threshold {audit.loss_threshold:g}",
    ]
    if tune is not None:
        meta.append(f"tolerance {tune.tolerance:.0%}")
    meta.insert(2, f"hmp {__version__}")
    summary = [
        ("loss error under the lists", _num(audit.output_error)),
        ("ops flagged", ", ".join(audit.flagged) or "none"),
        ("module classes flagged", ", ".join(audit.flagged_modules) or "none"),
        ("listed ops' forward time, one step", _timed_total(audit.rows)),
    ]
    if tune is not None:
        summary += [
            ("moved to FP32", ", ".join(tune.moved_to_fp32) or "none"),
            ("module classes to FP32", ", ".join(_class_names(tune)) or "none"),
            ("added to BF16", ", ".join(tune.added_to_bf16) or "none"),
        ]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        f"<title>{esc(title)}</title>",
        f"<style>{STYLE}</style>",
        "</head>",
        "<body>",
        f"<h1>{esc(title)}</h1>",
        f'<p class="meta">{esc(" | ".join(meta))}</p>',
        _summary(summary),
        legend(tune),
        "<h2>Ops: the error bf16 makes and the time it saves</h2>",
        '<p class="caption">One row per listed op the step ran, largest own error first. Own error: the op alone '
        "cast, against the fp32 run; error passed to the loss: the step's loss with only that op cast. An op whose "
        "inputs already arrive in its dtype casts nothing and has no own error. Time: the op's forward calls in one "
        "step in fp32 and one under the lists, casts included (backward is not split per op); one step each, so "
        "small differences are noise.</p>",
        f'<div class="scroll">{op_chart(audit, tune)}</div>',
        "<h2>Modules: where the error starts</h2>",
        '<p class="caption">Error made in it: its outputs against fp32 when only the ops called directly in it cast, '
        "from fp32 inputs. Output error: the same outputs under the lists, with all the error its inputs carry.</p>",
        f'<div class="scroll">{module_chart(audit, tune)}</div>',
    ]
    if audit.module_classes:
        parts += [
            "<h2>Module classes</h2>",
            table(
                [
                    "class",
                    "instances",
                    "calls",
                    "output max rel err",
                    "error made in it",
                    "largest own op error",
                    "flagged",
                ],
                [
                    [
                        r["class"],
                        r["instances"],
                        r["calls"],
                        _num(r["max_rel"]),
                        _num(r["made_max_rel"]),
                        f"{_num(r['own_max_rel'])} ({r['own_op']})" if r["own_op"] else "-",
                        r["reason"],
                    ]
                    for r in sorted(audit.module_classes, key=lambda r: _sort_key(r["made_max_rel"]))
                ],
                numeric=(1, 2, 3, 4),
            ),
        ]
    if audit.seen:
        parts += [
            "<h2>What this audit could not see</h2>",
            '<p class="caption">These module classes were given integer inputs (positions, timesteps, ids) up '
            "to the value shown: an error that grows with position or timestep is measured only up to there."
            "</p>",
            table(
                ["class", "largest integer input seen"],
                [[c, v] for c, v in sorted(audit.seen.items(), key=lambda kv: -kv[1])],
                numeric=(1,),
            ),
        ]
    if tune is not None:
        parts += [
            "<h2>Ops tried in bf16</h2>",
            '<p class="caption">Expensive ops still computing in fp32, each tried alone in bf16 and kept when its '
            "own error and the error it passes to the loss stay under the thresholds with no inf/NaN.</p>",
            f'<div class="scroll">{trial_chart(tune)}</div>',
        ]
        if tune.proposals:
            parts += [
                "<h2>Flagged ops whose error is confined to one module class</h2>",
                table(
                    [
                        "op",
                        "module class",
                        "own max rel err, class in FP32",
                        "error passed to loss",
                        "inf/NaN",
                        "class to FP32 instead of the op",
                    ],
                    [
                        [
                            op,
                            p["class"],
                            _num(p["own_max_rel"]),
                            _num(p["loss_error"]),
                            p["nonfinite"],
                            "yes" if p["accepted"] else "no",
                        ]
                        for op, p in tune.proposals.items()
                    ],
                    numeric=(2, 3, 4),
                ),
            ]
        if tune.module_proposals:
            parts += [
                "<h2>Module classes whose own code makes too much error</h2>",
                table(
                    ["module class", "error made in it", "error passed to loss, class in FP32", "inf/NaN", "to FP32"],
                    [
                        [
                            p["class"],
                            _num(p["made_max_rel"]),
                            _num(p["loss_error"]),
                            p["nonfinite"],
                            "yes" if p["accepted"] else "no",
                        ]
                        for p in tune.module_proposals.values()
                    ],
                    numeric=(1, 2, 3),
                ),
            ]
        parts += [
            "<h2>Validation</h2>",
            '<p class="caption">Final loss after training the same steps from the same state; step times are '
            "medians of interleaved runs.</p>",
            validation_table(tune),
        ]
    parts += ["</body>", "</html>", ""]
    # ASCII only: non-ASCII characters as character references, whatever the file's encoding
    return "\n".join(parts).encode("ascii", "xmlcharrefreplace").decode("ascii")


def _class_names(tune):
    return [class_path(c) for c in tune.modules_to_fp32]


def write(path, audit=None, tune=None, title=None):
    """Write render()'s page to ``path``: to a temporary file beside it,
    then renamed into place, so ``path`` is the old file or the whole new
    one. A ValueError naming ``path`` when it cannot be written."""
    text = render(audit, tune, title)
    (target,) = check_outputs([path], TOOL)
    temp = Path(target).with_name(f".{Path(target).name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
        os.replace(temp, target)
    except OSError as e:
        temp.unlink(missing_ok=True)
        raise ValueError(f"{TOOL}: cannot write {os.fspath(path)!r}: {e.strerror or e}") from e
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return os.fspath(path)
