"""The charts of hmp's HTML reports (page.py assembles the page): one
per op, per module and per op tune tried, and the legend that reads them."""

import math
import re

from hmp.tools import speed
from hmp.tools.report.svg import (
    BAD,
    FONT_FAMILY,
    FP32_TIME,
    LIST_COLOURS,
    LOW_TIME,
    OK,
    OUTPUT,
    OVER,
    SLOWER,
    TICK_FONT,
    UNCLEAR_TIME,
    BadgeColumn,
    BarColumn,
    LinearAxis,
    LogAxis,
    TextColumn,
    TimeColumn,
    _num,
    _round_step,
    chart,
    esc,
    svg_line,
    svg_rect,
    svg_text,
)
from hmp.tools.sentences import bounds_broken


def _sort_key(value):
    """Largest first; inf and NaN before everything (they need attention most)."""
    if value is None:
        return 1.0
    if math.isnan(value) or math.isinf(value):
        return -math.inf
    return -value


SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def _list_badge(kind, ran_in=""):
    """The list an op is in; an op in none that ran in a lower dtype (its inputs came in it, as
    scaled_dot_product_attention's do from bf16 projections) says so, not only "none"."""
    lower = [SHORT[d] for d in ran_in.split(",") if d in ("bfloat16", "float16")]
    word = kind or (f"none, ran {'/'.join(lower)}" if lower else "none")
    return (word, LIST_COLOURS.get(kind, LIST_COLOURS[None]))


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
        BadgeColumn("list", rows, lambda r: _list_badge(r["list"], r.get("ran_in", ""))),
        _error_column("own max rel error (only this op cast)", rows, "own_max_rel", own, threshold, _no_own_error),
        _error_column(
            "error it passes to the loss", rows, "loss_error", loss, loss_threshold, _no_own_error, "loss threshold"
        ),
        TimeColumn(
            "forward time: fp32, and under the lists relative to it",
            rows,
            lambda r: r.get("fp32_ms"),
            lambda r: r.get("lists_ms"),
            lambda r: r.get("time_ratio"),
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


def nothing_cast(row):
    """A module row (audit's) in whose own code nothing casts: no error made in it, no own op error."""
    return row["made_max_rel"] == 0 and row["own_op"] is None


def _short_class(row):
    """The class's own name: the last part of ``module.Class`` or ``file.py:Class``."""
    return re.split(r"[.:]", row["class"])[-1]


def module_chart(audit, tune=None):
    """The modules in which something casts; the rest are folded (page.py)."""
    rows = [r for r in audit.modules if not nothing_cast(r)]
    rows.sort(key=lambda r: (_sort_key(r["made_max_rel"]), _sort_key(r["max_rel"]), r["path"]))
    if not rows:
        if audit.modules:
            return '<p class="empty">Nothing is cast in the code of any module.</p>'
        return '<p class="empty">No module among the step\'s state and arguments ran.</p>'
    axis = LogAxis([r["made_max_rel"] for r in rows] + [r["max_rel"] for r in rows], 220, [audit.threshold])
    flagged = {r["class"]: r["reason"] for r in audit.module_classes if r["flagged"]}
    to_fp32 = (
        {p["class"] for p in (*tune.proposals.values(), *tune.module_proposals.values()) if p["accepted"]}
        if tune is not None
        else set()
    )

    def marker(row):
        if row["class"] in to_fp32:
            return ("class to FP32", OVER)
        if row["class"] in flagged:
            return ("class flagged: " + flagged[row["class"]], OVER)
        return ("", None)

    columns = [
        TextColumn("module", rows, lambda r: r["path"] or "(root)", cls="label"),
        TextColumn("class", rows, _short_class),
        _error_column("error made in it", rows, "made_max_rel", axis, audit.threshold),
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
        why = "none left in fp32 took a large enough share of the step"
        if getattr(tune, "authored", None):
            why = f"those left in fp32 that take a large enough share of the step ({', '.join(tune.authored)}) take "
            why += "their input in float32 because the model's author asked for it"
        return f'<p class="empty">No op was tried in bf16: {esc(why)}.</p>'
    threshold, loss_threshold = tune.audit.threshold, tune.audit.loss_threshold
    own = LogAxis([r["own_max_rel"] for r in rows], 220, [threshold])
    loss = LogAxis([r["loss_error"] for r in rows], 200, [loss_threshold])

    def outcome(r):
        if r.get("outcome"):  # tune's own words: the bounds, and whether a step measurably gained
            return (r["outcome"], LOW_TIME if r["accepted"] else OVER)
        if r["accepted"]:
            return ("kept in BF16", LOW_TIME)
        why = bounds_broken(r, threshold, loss_threshold)
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
        BarColumn(
            "fp32 time: % of the step it was measured in",
            rows,
            lambda r: 100 * r["seconds"] / r["step_seconds"] if r.get("step_seconds") else None,
            LinearAxis([100 * r["seconds"] / r["step_seconds"] for r in rows if r.get("step_seconds")], 150),
            colour=lambda row, value: FP32_TIME,
            fmt=lambda value: f"{value:.1f}%",
        ),
        TextColumn("outcome", rows, outcome),
    ]
    return chart(rows, columns, lambda r: f"{r['op']}: {r.get('why') or outcome(r)[0]}", "trials")


def _swatch(shape):
    return f'<svg width="22" height="12" viewBox="0 0 22 12">{shape}</svg>'


def legend(tune=None):
    items = [
        (svg_rect(1, 2, 20, 8, "swatch", OK), "error under the threshold"),
        (svg_rect(1, 2, 20, 8, "swatch", OVER), "error over the threshold"),
        (svg_line(11, 0, 11, 12, "swatch", BAD, ' stroke-dasharray="3,2" stroke-width="1.5"'), "threshold"),
        (svg_rect(1, 2, 20, 8, "swatch", BAD), "inf/NaN"),
        (svg_rect(1, 2, 20, 8, "swatch", OUTPUT), "a module's output error (with what its inputs carry)"),
        (
            svg_rect(1, 1, 20, 4, "swatch", FP32_TIME)
            + "".join(
                svg_rect(1 + 7 * i, 7, 6, 4, "swatch", c) for i, c in enumerate((LOW_TIME, SLOWER, UNCLEAR_TIME))
            ),
            speed.LEGEND,
        ),
    ]
    items += [
        (svg_rect(1, 1, 20, 10, "swatch", colour, ' rx="2"'), f"in the {kind.upper()} list" if kind else "in no list")
        for kind, colour in LIST_COLOURS.items()
    ]
    return '<ul class="legend">' + "".join(f"<li>{_swatch(shape)}{esc(label)}</li>" for shape, label in items) + "</ul>"


# a configuration's loss curve: fp32 grey, the starting lists blue, the tuned lists green (dashed where they are
# the same lists as an earlier curve, drawn over it)
CURVE_COLOURS = ("#555555", "#4c78a8", "#54a24b", "#f58518", "#b279a2")


def _segments(values, x, y):
    """Polylines through the finite values (a non-finite loss breaks the line)."""
    out, run = [], []
    for i, v in enumerate(values):
        if math.isfinite(v):
            run.append(f"{x(i):.1f},{y(v):.1f}")
        elif run:
            out.append(run)
            run = []
    return out + ([run] if run else [])


def loss_chart(tune, width=720, height=260):
    """The loss after each validation step, one line per configuration (tune.trajectories), on one axis; a
    legend names each line, its final loss and the lists it repeats."""
    curves = {name: list(losses) for name, losses in getattr(tune, "trajectories", {}).items() if losses}
    finite = [v for losses in curves.values() for v in losses if math.isfinite(v)]
    if not finite:
        return '<p class="empty">No loss was recorded per validation step.</p>'
    lo, hi = min(finite), max(finite)
    step = _round_step((hi - lo) / 4 if hi > lo else max(abs(hi), 1e-3) / 4)
    lo, hi = step * math.floor(lo / step), step * math.ceil(hi / step + 1e-9)
    hi = hi if hi > lo else lo + step
    steps = max(len(losses) for losses in curves.values())
    left, right, top, bottom = 64, 16, 14, 40
    plot_w, plot_h = width - left - right, height - top - bottom

    def x(i):
        return left + (i / (steps - 1) if steps > 1 else 0.5) * plot_w

    def y(v):
        return top + (hi - v) / (hi - lo) * plot_h

    out = [
        f'<svg class="losses" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'font-family="{esc(FONT_FAMILY)}" role="img"><title>loss after each validation step</title>'
    ]
    ticks = [lo + k * step for k in range(int(round((hi - lo) / step)) + 1)]
    for v in ticks:
        out.append(svg_line(left, y(v), left + plot_w, y(v), "grid", "#e3e3e3"))
        out.append(svg_text(left - 6, y(v) + 4, f"{v:.4g}", "tick-label", anchor="end", size=TICK_FONT))
    for i in sorted({0, steps - 1, (steps - 1) // 2}):
        out.append(svg_text(x(i), top + plot_h + 16, str(i + 1), "tick-label", anchor="middle", size=TICK_FONT))
    out.append(svg_text(left + plot_w / 2, height - 6, "validation step", "head", anchor="middle"))
    out.append(svg_line(left, top + plot_h, left + plot_w, top + plot_h, "axis", "#666666"))
    out.append(svg_line(left, top, left, top + plot_h, "axis", "#666666"))
    same = getattr(tune, "same_as", {})
    items = []
    for k, (name, losses) in enumerate(curves.items()):
        colour = CURVE_COLOURS[k % len(CURVE_COLOURS)]
        dash = ' stroke-dasharray="6,4"' if name in same else ""
        for run in _segments(losses, x, y):
            out.append(
                f'<polyline class="loss" data-name="{esc(name)}" points="{" ".join(run)}" fill="none" '
                f'stroke="{colour}" stroke-width="2"{dash}/>'
            )
        note = f" (same lists as {same[name]})" if name in same else ""
        swatch = svg_line(1, 6, 21, 6, "swatch", colour, f' stroke-width="2"{dash}')
        items.append((swatch, f"{name}{note}: final loss {_num(losses[-1], 5)}"))
    out.append("</svg>")
    listed = "".join(f"<li>{_swatch(shape)}{esc(label)}</li>" for shape, label in items)
    return "\n".join(out) + f'<ul class="legend">{listed}</ul>'
