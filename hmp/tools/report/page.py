"""One self-contained HTML page for hmp.audit and hmp.tune: a style sheet in
the page, inline SVG charts (charts.py, svg.py), no scripts, no external
assets.

The page leads with its verdict (the outcome: within or outside the
tolerance, faster, slower or no measurable difference), then what to do
(the files written, what their lines hold and the call that loads them),
then the evidence. The verdict's and what to do's sentences are made from
the numbers on the page (sentences.py; every word on speed, speed.py): a
verdict only where its interval lies on one side of its threshold, else
"cannot tell yet" and what to run, or where the machine did not let the
runs be measured, that. Every timing is relative to fp32 (timing.py), from
the same measurement wherever it shows. Nothing is wider than the page's 1280 px and nothing hides behind
a scroll bar of its own: a chart wider than its box scales down to fit it
(its viewBox keeps the proportions), a table's cells wrap.

``render(audit=None, tune=None, title=None)`` returns the page;
``write(path, ...)`` writes it atomically.
"""

import math
import os
import secrets
from datetime import datetime, timezone
from pathlib import Path

import torch

from hmp.tools import speed
from hmp.tools.files import check_outputs
from hmp.tools.report.charts import _sort_key, legend, loss_chart, module_chart, nothing_cast, op_chart, trial_chart
from hmp.tools.report.svg import _num, esc
from hmp.tools.sentences import (  # noqa: F401 (DEFAULT_FILES: this module's name before)
    DEFAULT_FILES,
    OUTSIDE,
    WITHIN,
    audit_outcome,
    audit_todo,
    loss_state,
    tune_outcome,
    tune_todo,
)
from hmp.version import __version__

TOOL = "hmp.tools.report"

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


def boxed(inner):
    """``inner`` in a box as wide as the page at most: a chart in it scales down to fit, a table wraps."""
    return f'<div class="box">{inner}</div>'


def folded(summary, items, kind="names"):
    """One line that opens onto ``items``: short names in columns (``names``),
    or sentences one per line (``lines``)."""
    listed = "".join(f"<li>{esc(item)}</li>" for item in items)
    return f'<details class="folded"><summary>{esc(summary)}</summary><ul class="{kind}">{listed}</ul></details>'


def _nothing_cast_in(count, what):
    plural = what + ("es" if what.endswith("s") else "s")
    return f"{count} {what if count == 1 else plural} with nothing cast in {'it' if count == 1 else 'them'}"


def validation_table(tune):
    """The validation rows from the TuneResult's own measures (loss_gap,
    time_cell: the ratios the verdict uses), each row's verdict against its
    tolerance."""
    rows = []
    for name, value in tune.validation.items():
        label = name + (f" (same lists as {tune.same_as[name]})" if name in tune.same_as else "")
        rel = "" if name == "fp32" else f"{tune.loss_gap(name):+.2%}"
        rows.append([label, f"{value:.5f}", rel, tune.time_cell(name), _validation_verdict(tune, name)])
    return table(
        ["lists", "final loss", "vs fp32's loss", "step time vs fp32 (below 1 is faster)", "verdict"],
        rows,
        numeric=(1, 2, 3),
    )


def _validation_verdict(tune, name):
    if name == "fp32":
        return "reference"
    if not (math.isfinite(tune.validation[name]) and math.isfinite(tune.validation["fp32"])):
        return "diverged"
    gap = abs(tune.loss_gap(name))
    if name != "tuned lists":
        return ""
    state = loss_state(tune.loss_gaps(name), tune.tolerance)
    if state == WITHIN:
        return f"within tolerance ({tune.tolerance:.0%} of fp32's loss)"
    if state != OUTSIDE:
        return f"cannot tell yet: over the last steps both within and outside the {tune.tolerance:.0%} tolerance"
    if gap <= abs(tune.loss_gap("starting lists")):
        return f"outside tolerance ({tune.tolerance:.0%}), but no further than the starting lists"
    return f"outside tolerance ({tune.tolerance:.0%})"


# --- the verdict and what to do ---------------------------------------------------------------------------------------


def _flagged_words(audit):
    if audit.flagged:
        return ", ".join(audit.flagged)
    return "none alone: each op cast by itself stays under the thresholds"


def verdict_first(audit, tune):
    state, sentences = tune_outcome(tune) if tune is not None else audit_outcome(audit)
    todo = tune_todo(tune) if tune is not None else audit_todo(audit)
    outcome = "".join(f"<p>{esc(s)}</p>" for s in sentences)
    look = {WITHIN: "ok", OUTSIDE: "bad"}.get(state, "unsure")
    return [
        f'<section id="verdict" class="verdict {look}"><h2>Verdict</h2>{outcome}</section>',
        '<section id="todo"><h2>What to do</h2>' + "".join(todo) + "</section>",
    ]


# --- the evidence ---------------------------------------------------------------------------------------------------

STYLE = """
html, body { margin: 0; padding: 0; }
body { font-family: system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif; color: #222; box-sizing: border-box;
       max-width: 1280px; padding: 16px 24px; }  /* the widest the page gets; wider charts scale down */
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 24px 0 8px; }
p, li, dd, td, th, pre, summary { overflow-wrap: anywhere; }
p.meta { color: #555; margin-top: 0; } p.caption { color: #444; max-width: 70em; }
section.verdict { border-left: 6px solid; padding: 2px 14px; margin: 12px 0; font-size: 15px; }
section.verdict h2 { margin-top: 8px; }
section.verdict.ok { border-color: #54a24b; background: #f1f8ef; }
section.verdict.bad { border-color: #c0392b; background: #fbefed; }
section.verdict.unsure { border-color: #b7950b; background: #fdf8e6; }
pre.call { background: #f4f4f4; padding: 8px 12px; white-space: pre-wrap; font-size: 13px; }
.box { max-width: 100%; overflow-x: auto; }  /* a safety: the test checks nothing in a box overflows it */
.box > svg { display: block; max-width: 100%; height: auto; }  /* a wide chart scales down to its box */
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; max-width: 100%; }
ul.changes li { margin: 2px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; } td.num { text-align: right; }
ul.legend { list-style: none; padding: 0; display: flex; flex-wrap: wrap; gap: 6px 18px; font-size: 13px; }
ul.legend svg { vertical-align: middle; margin-right: 4px; }
ul.names { columns: 18em; font-size: 13px; }
ul.lines { font-size: 13px; }
svg text.note { paint-order: stroke; stroke: #ffffff; stroke-width: 3px; }
dl.summary { display: grid; grid-template-columns: max-content minmax(0, 1fr); gap: 2px 12px; font-size: 14px; }
dl.summary dt { color: #555; } dl.summary dd { margin: 0; }
"""


def _summary(items):
    return '<dl class="summary">' + "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in items) + "</dl>"


def summary(audit, tune):
    items = [
        ("loss error after one step under the lists", _num(audit.output_error)),
        ("ops flagged", _flagged_words(audit)),
        ("module classes flagged", ", ".join(audit.flagged_modules) or "none"),
    ]
    if tune is None:
        items.append(("listed ops' forward time under the lists", speed.words(audit.time_ratio)))
    else:
        items.append(("step time under the tuned lists", tune.time_cell("tuned lists")))
    return _summary(items)


def op_section(audit, tune):
    pairs = audit.time_ratio.load.taken if getattr(audit.time_ratio, "load", None) else _pairs(audit)
    steps = speed.recorded_steps(getattr(audit, "step_ms", None) or {}) if tune is None else speed.ONE_STEP
    return [
        "<h2>Ops: the error bf16 makes and the time it saves</h2>",
        '<p class="caption">One row per listed op the step ran, largest own error first. Own error: the op alone '
        "cast, against the fp32 run; error passed to the loss: the step's loss with only that op cast. An op whose "
        f"inputs already arrive in its dtype casts nothing and has no own error. {esc(speed.op_caption(pairs))}"
        f"{esc(steps)}</p>",
        boxed(op_chart(audit, tune)),
    ]


def _pairs(audit):
    return audit.time_ratio.pairs if audit.time_ratio is not None else "a few"


def module_section(audit, tune):
    quiet = [r["path"] or "(root)" for r in audit.modules if nothing_cast(r)]
    out = [
        "<h2>Modules: where the error starts</h2>",
        '<p class="caption">Error made in it: its outputs against fp32 when only the ops called directly in it cast, '
        "from fp32 inputs. Output error: the same outputs under the lists, with all the error its inputs carry.</p>",
        boxed(module_chart(audit, tune)),
    ]
    if quiet:
        out.append(folded(_nothing_cast_in(len(quiet), "module"), quiet))
    return out


def class_section(audit):
    if not audit.module_classes:
        return []
    rows = sorted(audit.module_classes, key=lambda r: _sort_key(r["made_max_rel"]))
    quiet = [r for r in rows if r["made_max_rel"] == 0 and r["own_op"] is None]
    shown = [r for r in rows if r not in quiet]
    out = ["<h2>Module classes</h2>"]
    if shown:
        headers = ["class", "instances", "calls", "output max rel err", "error made in it", "largest own op error"]
        cells = [
            [r["class"], r["instances"], r["calls"], _num(r["max_rel"]), _num(r["made_max_rel"])]
            + [f"{_num(r['own_max_rel'])} ({r['own_op']})" if r["own_op"] else "-", r["reason"] or "no"]
            for r in shown
        ]
        out.append(boxed(table(headers + ["flagged"], cells, numeric=(1, 2, 3, 4))))
    if quiet:
        out.append(folded(_nothing_cast_in(len(quiet), "module class"), [r["class"] for r in quiet]))
    return out


def uncast_section(audit):
    """The entries of the audited lists hmp does not cast, each with why: what a line of a list does."""
    if not audit.uncast:
        return []
    n = sum(len(entries) for entries in audit.uncast.values())
    return [
        "<h2>List entries not cast</h2>",
        folded(
            f"{n} entr{'y' if n == 1 else 'ies'} of the lists hmp does not cast, and why",
            [f"{', '.join(entries)}: {why}" for why, entries in audit.uncast.items()],
            kind="lines",
        ),
    ]


def unseen_section(audit):
    if not audit.seen:
        return []
    return [
        "<h2>What this audit could not see</h2>",
        '<p class="caption">These module classes were given integer inputs (positions, timesteps, ids) up '
        "to the value shown: an error that grows with position or timestep is measured only up to there.</p>",
        boxed(
            table(
                ["class", "largest integer input seen"],
                [[c, v] for c, v in sorted(audit.seen.items(), key=lambda kv: -kv[1])],
                numeric=(1,),
            )
        ),
    ]


def proposal_sections(tune):
    out = []
    if tune.proposals:
        headers = ["op", "module class", "own max rel err, class in FP32", "error passed to loss", "inf/NaN"]
        cells = [
            [op, p["class"], _num(p["own_max_rel"]), _num(p["loss_error"]), p["nonfinite"]]
            + ["yes" if p["accepted"] else "no"]
            for op, p in tune.proposals.items()
        ]
        out += [
            "<h2>Flagged ops whose error is confined to one module class</h2>",
            boxed(table(headers + ["class to FP32 instead of the op"], cells, numeric=(2, 3, 4))),
        ]
    over, under = tune.class_proposals()
    if over:
        cells = [
            [
                p["class"],
                _num(p["made_max_rel"]),
                _num(p["loss_error"]),
                p["nonfinite"],
                "yes" if p["accepted"] else "no",
            ]
            for p in over
        ]
        headers = ["module class", "error made in it", "error passed to loss, class in FP32", "inf/NaN", "to FP32"]
        out += [
            "<h2>Module classes whose own code makes too much error</h2>",
            '<p class="caption">Measured again with the flagged ops moved to FP32.</p>',
            boxed(table(headers, cells, numeric=(1, 2, 3))),
        ]
    if under:
        out.append(f'<p class="caption">Module classes {esc(tune.left_as_they_are(under))}.</p>')
    return out


def tune_sections(tune):
    fp32_step = tune.fp32_step() if "fp32" in tune.timings else ""
    return [
        "<h2>Ops tried in bf16</h2>",
        '<p class="caption">Expensive ops still computing in fp32, each tried alone in bf16 and kept when its '
        "own error and the error it passes to the loss stay under the thresholds with no inf/NaN, and a step with "
        "it in bf16 is faster than without beyond chance (adjacent step pairs; hover a row for why). Each op's "
        "time is a share of the step it was measured in (recorded op by op).</p>",
        boxed(trial_chart(tune)),
        *proposal_sections(tune),
        "<h2>Validation</h2>",
        f'<p class="caption">{esc(speed.validation_caption(fp32_step))}</p>',
        boxed(validation_table(tune)),
        boxed(loss_chart(tune)),
    ]


# --- the page -------------------------------------------------------------------------------------------------------


def _meta(audit, tune):
    created = getattr(audit, "created", None) or datetime.now(timezone.utc)
    meta = [
        f"measured {created.strftime('%Y-%m-%d %H:%M UTC')}",
        f"torch {torch.__version__}",
        f"hmp {__version__}",
        f"threshold {audit.threshold:g} (an op's own error, error made in a module)",
        f"loss threshold {audit.loss_threshold:g}",
    ]
    if tune is not None:
        meta.append(f"tolerance {tune.tolerance:.0%}")
    return f'<p class="meta">{esc(" | ".join(meta))}</p>'


def render(audit=None, tune=None, title=None):
    """The HTML page for an audit report and/or a tune result (whose audit
    is used when ``audit`` is not given)."""
    if audit is None and tune is None:
        raise ValueError(f"{TOOL}: give an audit report (hmp.audit's) or a tune result (hmp.tune's)")
    if audit is None:
        audit = tune.audit
    title = title or f"hmp {'tune' if tune is not None else 'audit'} report"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title>",
        f"<style>{STYLE}</style>",
        "</head>",
        "<body>",
        f"<h1>{esc(title)}</h1>",
        *verdict_first(audit, tune),
        "<h2>The evidence</h2>",
        _meta(audit, tune),
        summary(audit, tune),
        legend(tune),
        *op_section(audit, tune),
        *module_section(audit, tune),
        *class_section(audit),
        *uncast_section(audit),
        *unseen_section(audit),
        *(tune_sections(tune) if tune is not None else ()),
        "</body>",
        "</html>",
        "",
    ]
    # ASCII only: non-ASCII characters as character references, whatever the file's encoding
    return "\n".join(parts).encode("ascii", "xmlcharrefreplace").decode("ascii")


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
