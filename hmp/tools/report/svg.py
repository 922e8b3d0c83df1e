"""Inline SVG bar charts for hmp's HTML reports: axes, columns, one chart.

Each chart has one row per item and one column per quantity, each column
as wide as its widest text needs: labels sit in their own column and never
overlap each other or a bar. Errors are bars on a log axis with the
threshold as a dashed line; a value the axis cannot show (0, inf, NaN,
nothing measured) gets a note in its cell instead of a bar. Text is
monospace, so a label's width is its length times 0.6 em.
"""

import html
import math

from hmp.binding import kinds
from hmp.tools import speed

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
UNCLEAR_TIME = "#c9c9c9"  # time under the lists with no measurable difference from fp32
OUTPUT = "#9ecae9"  # a module's output error: what reaches it, not what it makes
# each list kind's colour, in the kinds' order (hmp/binding/kinds.py); None: an op in no list
LIST_COLOURS = {**dict(zip(kinds.names(), ("#1b9e77", "#7570b3", "#a6761d", "#e7298a"))), None: "#8c8c8c"}
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


def svg_text(x, y, text, cls, anchor="start", size=FONT, fill=None, weight=None):
    extra = f' fill="{fill}"' if fill else ""
    extra += f' font-weight="{weight}"' if weight else ""
    return (
        f'<text class="{cls}" x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{extra}>'
        f"{esc(text)}</text>"
    )


def svg_rect(x, y, w, h, cls, fill, extra=""):
    return f'<rect class="{cls}" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}"{extra}/>'


def svg_line(x1, y1, x2, y2, cls, stroke, extra=""):
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
        return [svg_text(x, _baseline(top), text, self.cls, fill=colour, weight=self.weight)] if text else []


class BadgeColumn(Column):
    """A coloured marker with a word per row (which list an op is in)."""

    def __init__(self, title, rows, get):
        self.title, self.get = title, get
        self.inner = max([text_width(self.get(r)[0]) for r in rows] + [0]) + 8
        self.width = max(text_width(title), self.inner)

    def cell(self, row, x, top):
        word, colour = self.get(row)
        return [
            svg_rect(x, top + 3, self.inner, ROW - 6, "badge", colour, ' rx="3"'),
            svg_text(x + self.inner / 2, _baseline(top), word, "badge-text", anchor="middle", fill="#ffffff"),
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
                + svg_text(x + self.inset + offset, TICK_Y, label, "tick-label", anchor="middle", size=TICK_FONT)
                + "</g>"
            )
        for value, label in self.marks:
            # the label centred on its line, kept within the column
            w = text_width(label)
            centre = x + self.inset + self.axis.at(value)
            left = min(max(centre - w / 2, x), x + self.width - w)
            out.append(svg_text(left, MARK_Y, label, "mark-label", fill=BAD))
        return out

    def overlay(self, x, top, bottom):
        x0 = x + self.inset
        out = [
            svg_line(x0 + offset, AXIS_Y, x0 + offset, bottom, "grid", "#e3e3e3") for _, offset, _ in self.axis.ticks()
        ]
        out.append(svg_line(x0, AXIS_Y, x0 + self.axis.width, AXIS_Y, "axis", "#666666"))
        for value, _ in self.marks:
            at = x0 + self.axis.at(value)
            out.append(
                svg_line(
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
            return [svg_text(x0 + 2, _baseline(top), note, "note", fill="#555555")]
        length, _ = self.axis.bar(value)
        return [
            svg_rect(x0, top + BAR_TOP, length, BAR_H, "bar", self.colour(row, value), f' data-value="{value:g}"'),
            svg_text(x + self.value_x, _baseline(top), text, "value"),
        ]


class TimeColumn(Column):
    """fp32 time and time under the lists, two thin bars per row on one
    linear axis; after the plot the fp32 ms and the time under the lists
    relative to fp32 (``ratio(row)``, a timing.Ratio or None: the same unit
    as every other timing), "not measured" when there is no fp32 time."""

    def __init__(self, title, rows, fp32, low, ratio=lambda row: None, width=150):
        self.title, self.fp32, self.low, self.ratio = title, fp32, low, ratio
        self.axis = LinearAxis([fp32(r) for r in rows] + [low(r) for r in rows], width)
        self.inset = self.axis.widest_tick() / 2 + 2
        texts = [self._label(r) for r in rows]
        self.value_x = self.inset + self.axis.width + 6
        self.width = max(text_width(title), self.value_x + max([text_width(t) for t in texts] + [0]) + 4)

    def _label(self, row):
        a, b = self.fp32(row), self.low(row)
        if a is None:
            return "not measured"
        if b is None:
            return f"{a:.3g} ms"
        ratio = self.ratio(row)
        return f"{a:.3g} ms; lists: {speed.short(ratio) if ratio is not None else speed.UNCLEAR}"

    def header(self, x):
        return [
            f'<g class="tick" data-value="{value:g}">'
            + svg_text(x + self.inset + offset, TICK_Y, label, "tick-label", anchor="middle", size=TICK_FONT)
            + "</g>"
            for value, offset, label in self.axis.ticks()
        ]

    def overlay(self, x, top, bottom):
        x0 = x + self.inset
        out = [
            svg_line(x0 + offset, AXIS_Y, x0 + offset, bottom, "grid", "#e3e3e3") for _, offset, _ in self.axis.ticks()
        ]
        return out + [svg_line(x0, AXIS_Y, x0 + self.axis.width, AXIS_Y, "axis", "#666666")]

    def cell(self, row, x, top):
        a, b = self.fp32(row), self.low(row)
        x0 = x + self.inset
        if a is None:
            return [svg_text(x0 + 2, _baseline(top), "not measured", "note", fill="#555555")]
        out = []
        length, _ = self.axis.bar(a)
        if length:
            out.append(svg_rect(x0, top + 3, length, 6, "bar time-fp32", FP32_TIME, f' data-value="{a:g}"'))
        if b is not None:
            length, _ = self.axis.bar(b)
            if length:
                fill = {"slower": SLOWER, "faster": LOW_TIME}.get(speed.colour_key(self.ratio(row)), UNCLEAR_TIME)
                out.append(svg_rect(x0, top + 11, length, 6, "bar time-low", fill, f' data-value="{b:g}"'))
        out.append(svg_text(x + self.value_x, _baseline(top), self._label(row), "value"))
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
            out.append(svg_rect(0, HEAD + ROW * i, width, ROW, "stripe", "#f6f6f6"))
    for column, cx in zip(columns, xs):
        out.append(f'<g class="column" data-title="{esc(column.title)}">')
        out.append(svg_text(cx, TITLE_Y, column.title, "head", weight="bold"))
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
