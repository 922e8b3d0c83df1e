"""The HTML report of hmp.audit / hmp.tune (hmp/tools/report/) and per-op times
(audit's fp32_ms / lists_ms).

The charts are read back as XML and checked geometrically: a text's box is
its length times font size times 0.6 wide (the report's monospace font),
from 0.8 font sizes above its baseline to 0.2 below.
"""

import html
import html.parser
import math
import os
import re
import xml.etree.ElementTree as ET

import pytest
import torch
from helpers import classification_problem, op_row
from helpers.models import LinearNormLinear
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hmp
from hmp.tools.audit_report import AuditReport
from hmp.tools.op_costs import TIMED_PAIRS
from hmp.tools.report import page as report
from hmp.tools.report import svg as drawing

OVER_COLOUR = drawing.OVER


class Tiny(LinearNormLinear):
    def forward(self, x):
        h = self.norm(self.fc1(x))
        attention = torch.tanh(torch.softmax(h @ h.t() / 4, dim=-1))  # tanh: unlisted, fp32 inputs: tune tries it
        return self.fc2(attention @ h)


def tiny_problem():
    return classification_problem(Tiny, 16, 8)


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only spin against each other on a shared machine
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def audited(one_thread):
    model, opt, step, x, y = tiny_problem()
    try:
        return hmp.audit(step, x, y, state=(model, opt))
    finally:
        hmp.revert()


@pytest.fixture(scope="module")
def tuned(one_thread):
    model, opt, step, x, y = tiny_problem()
    try:
        return hmp.tune(step, x, y, state=(model, opt), steps=2, rounds=1, min_share=0.0)
    finally:
        hmp.revert()


# --- reading the page back -----------------------------------------------------------------------------------------


def svgs(page):
    """{class: parsed <svg>} of the page's charts (the legend's swatches left out)."""
    out = {}
    for match in re.finditer(r"<svg\b.*?</svg>", page, re.S):
        root = ET.fromstring(match.group(0))
        name = root.get("class")
        if name:
            assert name not in out
            out[name] = root
    return out


def classes(el):
    return (el.get("class") or "").split()


def text_box(el):
    size, x, y = float(el.get("font-size")), float(el.get("x")), float(el.get("y"))
    width = len(el.text or "") * size * 0.6
    left = {"start": x, "middle": x - width / 2, "end": x - width}[el.get("text-anchor", "start")]
    return (left, y - 0.8 * size, left + width, y + 0.2 * size)


def rect_box(el):
    x, y = float(el.get("x")), float(el.get("y"))
    return (x, y, x + float(el.get("width")), y + float(el.get("height")))


def overlap(a, b, eps=0.05):
    return a[0] < b[2] - eps and b[0] < a[2] - eps and a[1] < b[3] - eps and b[1] < a[3] - eps


def texts(svg):
    return [el for el in svg.iter("text")]


def bars(svg):
    return [el for el in svg.iter("rect") if "bar" in classes(el)]


def labels(svg):
    return [el.text for el in svg.iter("text") if "label" in classes(el)]


def assert_no_overlaps(svg):
    words = [(el.text, text_box(el)) for el in texts(svg)]
    shapes = [(el.get("data-value"), rect_box(el)) for el in bars(svg)]
    width, height = float(svg.get("width")), float(svg.get("height"))
    for i, (word, box) in enumerate(words):
        assert box[0] >= -0.05 and box[2] <= width + 0.05 and box[1] >= 0 and box[3] <= height, word
        for other, other_box in words[i + 1 :]:
            assert not overlap(box, other_box), (word, other)
        for value, bar in shapes:
            assert not overlap(box, bar), (word, value)


def log_x(ticks, value):
    """Where ``value`` sits between the two ticks around it, on a log scale: an oracle from the drawn ticks."""
    below = max((t for t in ticks if t[0] <= value), key=lambda t: t[0])
    above = min((t for t in ticks if t[0] >= value), key=lambda t: t[0])
    if below[0] == above[0]:
        return below[1]
    share = (math.log10(value) - math.log10(below[0])) / (math.log10(above[0]) - math.log10(below[0]))
    return below[1] + share * (above[1] - below[1])


def column_ticks(column):
    return [
        (float(g.get("data-value")), float(g.find("text").get("x"))) for g in column.iter("g") if "tick" in classes(g)
    ]


class Refs(html.parser.HTMLParser):
    """Every tag and every src/href the page has."""

    def __init__(self):
        super().__init__()
        self.tags, self.refs = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.refs += [value for name, value in attrs if name in ("src", "href", "xlink:href") and value]


# --- per-op times ------------------------------------------------------------------------------------------------


def test_audit_rows_carry_per_op_times(audited):
    for row in audited.rows:
        assert set(row) >= {"fp32_ms", "lists_ms", "cast_ms"}
        if row["casts"]:  # every op that casts runs in both timed steps, under the rows' names
            assert row["fp32_ms"] > 0 and row["lists_ms"] > 0 and 0 <= row["cast_ms"] <= row["lists_ms"], row["op"]
    assert {"linear", "matmul", "softmax"} <= {r["op"] for r in audited.rows}


# --- the audit's page -----------------------------------------------------------------------------------------------


def test_every_op_is_one_label_and_no_other_row(audited):
    charts = svgs(report.render(audit=audited))
    names = labels(charts["ops"])
    assert sorted(names) == sorted(r["op"] for r in audited.rows)
    assert len(names) == len(set(names))
    # one row per op: as many label rows as the chart is tall
    rows = (float(charts["ops"].get("height")) - drawing.HEAD - drawing.PAD) / drawing.ROW
    assert rows == len(audited.rows)
    # the modules something is cast in are charted; the rest fold into one line that names them
    cast = [r for r in audited.modules if r["made_max_rel"] > 0 or r["own_op"] is not None]
    quiet = [r["path"] or "(root)" for r in audited.modules if r not in cast]
    assert quiet and cast  # norm's inputs arrive in bf16: nothing cast in it
    assert sorted(labels(charts["modules"])) == sorted(r["path"] or "(root)" for r in cast)
    page = report.render(audit=audited)
    folded = re.search(r"<details[^>]*><summary>(.*?)</summary>(.*?)</details>", page, re.S)
    noun = "module with nothing cast in it" if len(quiet) == 1 else "modules with nothing cast in them"
    assert folded.group(1) == f"{len(quiet)} {noun}"
    assert re.findall(r"<li>(.*?)</li>", folded.group(2)) == quiet


def test_labels_overlap_nothing(audited, tuned):
    for page in (report.render(audit=audited), report.render(tune=tuned)):
        charts = svgs(page)
        assert {"ops", "modules"} <= set(charts)
        for svg in charts.values():
            assert_no_overlaps(svg)


def test_threshold_line_and_bars_sit_at_their_values(audited):
    charts = svgs(report.render(audit=audited))
    checked = 0
    for name in ("ops", "modules"):
        svg = charts[name]
        for column in (g for g in svg.iter("g") if "column" in classes(g)):
            lines = [el for el in column.iter("line") if "threshold" in classes(el)]
            if not lines:
                continue
            ticks = column_ticks(column)
            (line,) = lines
            value = float(line.get("data-value"))
            assert value in (audited.threshold, audited.loss_threshold)
            assert float(line.get("x1")) == pytest.approx(log_x(ticks, value), abs=0.6)
            # the column's bars: those that start where its axis starts
            start = float(next(el for el in column.iter("line") if "axis" in classes(el)).get("x1"))
            for bar in (b for b in bars(svg) if abs(float(b.get("x")) - start) < 0.01):
                v = float(bar.get("data-value"))
                end = float(bar.get("x")) + float(bar.get("width"))
                assert end == pytest.approx(max(log_x(ticks, v), start + drawing.MIN_BAR), abs=0.6)
                assert (bar.get("fill") == OVER_COLOUR) == (v > value)
                checked += 1
    assert checked >= len([r for r in audited.rows if r["own_max_rel"] > 0])


def test_page_is_self_contained(audited, tuned):
    for page in (report.render(audit=audited), report.render(tune=tuned)):
        parser = Refs()
        parser.feed(page)
        assert parser.refs == []
        assert not {"script", "link", "img", "iframe", "object"} & set(parser.tags)
        assert "http://" not in page and "https://" not in page and "url(" not in page
        assert page.isascii()


def fake_report(op, path):
    """An AuditReport built by hand: an op and a module path of our choosing,
    and values a chart cannot draw as bars (0, inf, NaN, not timed)."""
    rows = [
        op_row(op, 0.2, 1e-3, fp32_ms=1.5, lists_ms=0.5),
        op_row("nan_op", float("nan"), float("inf")),
        op_row("zero_op", 0.0, 0.0),
        op_row("quiet", 0.0, 0.0, casts=0),
    ]
    rows[0].update(flagged=True, reason="error 0.2 > 0.05 <&>")
    module = {
        "path": path,
        "class": "torch.nn.modules.linear.Linear",
        "type": torch.nn.Linear,
        "calls": 1,
        "max_rel": 0.01,
        "mean_rel": 0.01,
        "nonfinite": 0,
        "own_max_rel": 0.2,
        "own_op": op,
        "made_max_rel": 0.2,
    }
    return AuditReport(rows, 0.01, 0.05, 2e-3, [module], {"x<y>": 3})


def test_text_is_escaped_and_odd_values_get_notes():
    op, path = "<b>&\"mul'", "blocks.<0>&a"
    page = report.render(audit=fake_report(op, path), title="<script>alert(1)</script>")
    assert "<b>" not in page and "<script>" not in page and "<0>" not in page and "x<y>" not in page
    charts = svgs(page)  # parses only if every & and < is escaped
    assert labels(charts["ops"]).count(op) == 1 and labels(charts["modules"]) == [path]
    notes = [el.text for el in charts["ops"].iter("text") if "note" in classes(el)]
    assert {"NaN", "inf", "0", "casts nothing: no own error", "not measured"} <= set(notes)
    assert "&lt;script&gt;" in page
    assert_no_overlaps(charts["ops"])
    assert_no_overlaps(charts["modules"])


def test_write_is_atomic_and_names_the_path_on_error(audited, tmp_path, monkeypatch):
    target = tmp_path / "audit.html"
    target.write_text("old")
    assert report.write(target, audit=audited) == os.fspath(target)
    assert target.read_text() == report.render(audit=audited)
    assert os.listdir(tmp_path) == ["audit.html"]  # no temporary file left

    missing = tmp_path / "no" / "such" / "report.html"
    with pytest.raises(ValueError, match=re.escape(repr(os.fspath(missing)))):
        report.write(missing, audit=audited)
    with pytest.raises(ValueError, match=re.escape(repr(os.fspath(tmp_path)))):
        report.write(tmp_path, audit=audited)

    target.write_text("old")

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report.os, "replace", failing_replace)
    with pytest.raises(ValueError, match=re.escape(repr(os.fspath(target)))):
        report.write(target, audit=audited)
    monkeypatch.undo()
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["audit.html"]
    with pytest.raises(AttributeError):
        report.write(target, audit=object())  # nothing to render: the old file stays
    assert target.read_text() == "old"
    with pytest.raises(ValueError, match="audit report"):
        report.render()


def test_save_html(audited, tmp_path):
    path = tmp_path / "audit.html"
    audited.save_html(path)
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>") and f"torch {torch.__version__}" in page
    assert f"threshold {audited.threshold:g}" in page and f"loss threshold {audited.loss_threshold:g}" in page


# --- the tune page --------------------------------------------------------------------------------------------------


def test_tune_page_has_trials_and_validation(tuned):
    page = report.render(tune=tuned)
    charts = svgs(page)
    assert sorted(labels(charts["trials"])) == sorted(tuned.trials) and tuned.trials
    assert sorted(labels(charts["ops"])) == sorted(r["op"] for r in tuned.audit.rows)
    ordered = [t for _, t in sorted(tuned.trials.items(), key=lambda kv: (-kv[1]["seconds"], kv[0]))]
    texts = [el.text for el in charts["trials"].iter("text")]
    assert [t["outcome"] for t in ordered] == [x for x in texts if x in {t["outcome"] for t in ordered}]
    # a trial within the error bounds was timed, and kept only when a step measurably gained
    for t in ordered:
        assert not t["accepted"] or t["time_ratio"].faster
        assert t["outcome"].startswith("kept") == t["accepted"] and t["why"].startswith("kept") == t["accepted"]
    for name, loss in tuned.validation.items():
        assert f"<td>{name}" in page and f'<td class="num">{loss:.5f}</td>' in page
    assert "Validation" in page and "reference" in page


def test_each_tools_control_is_named_where_it_is_timed(audited, tuned):
    """A real tune's and a real audit's control carry what they timed twice, so every sentence says it alike
    (speed.control_words reads it), through their JSON too."""
    from hmp.tools import speed, timing

    for control, name in (
        (tuned.ratio("tuned lists").control, "the starting lists"),
        (audited.time_ratio.control, "the lists"),
    ):
        assert control is not None and control.timed == name
        assert speed.control_words(control).startswith(f"{name} timed twice: ")
        assert timing.Ratio.from_dict(control.as_dict()).timed == name


# --- the axes, for any values ---------------------------------------------------------------------------------------

values = st.one_of(st.floats(min_value=1e-40, max_value=1e6), st.sampled_from([0.0, math.inf, math.nan, -1.0, None]))


@settings(deadline=None)
@given(
    st.lists(values, min_size=1, max_size=30),
    st.floats(min_value=40, max_value=600),
    st.floats(min_value=1e-6, max_value=10),
)
def test_log_axis_bars(vals, width, threshold):
    axis = drawing.LogAxis(vals, width, [threshold])
    drawn = []
    for v in vals:
        length, note = axis.bar(v)
        assert 0 <= length <= width
        if v is None or not math.isfinite(v) or v <= 0:
            assert length == 0 and note  # a visible note, not a bar
        elif note is None:
            assert length >= drawing.MIN_BAR
            drawn.append((v, length))
        else:
            assert length == 0 and note.startswith("below")
    # the axis spans MAX_DECADES (8) powers of ten up from the one at or above the largest value or
    # mark: a value within 7 decades of that largest one gets a bar, one more than 8 below it a note
    top = max([v for v in vals if v is not None and math.isfinite(v) and v > 0] + [threshold])
    for v in vals:
        if v is not None and math.isfinite(v) and v > 0:
            if top / v <= 1e7:
                assert axis.bar(v)[1] is None, v
            elif top / v > 1e8:
                assert axis.bar(v)[1].startswith("below"), v
    # the oracle: bars grow with the value, and in proportion to its log where no bar is clamped
    drawn.sort()
    for (_, la), (_, lb) in zip(drawn, drawn[1:]):
        assert la <= lb + 1e-9
    unclamped = [(v, n) for v, n in drawn if n > drawing.MIN_BAR]
    if len(unclamped) >= 3 and unclamped[-1][0] > unclamped[0][0] * 1.01:
        (a, la), (b, lb), (c, lc) = unclamped[0], unclamped[len(unclamped) // 2], unclamped[-1]
        expected = (math.log10(b) - math.log10(a)) / (math.log10(c) - math.log10(a))
        assert (lb - la) / (lc - la) == pytest.approx(expected, abs=1e-6)
    assert 0 <= axis.at(threshold) <= width
    ticks = axis.ticks()
    for (_, xa, ta), (_, xb, tb) in zip(ticks, ticks[1:]):
        gap = xb - xa
        assert (
            gap > 0
            and gap >= (drawing.text_width(ta, drawing.TICK_FONT) + drawing.text_width(tb, drawing.TICK_FONT)) / 2
        )


@settings(deadline=None)
@given(st.lists(values, min_size=1, max_size=20), st.floats(min_value=40, max_value=400))
def test_linear_axis_bars(vals, width):
    axis = drawing.LinearAxis(vals, width)
    lengths = []
    for v in vals:
        length, note = axis.bar(v)
        assert 0 <= length <= width
        if v is None or not math.isfinite(v) or v < 0:
            assert length == 0 and note
        elif v > 0:
            lengths.append((v, length))
    lengths.sort()
    for (_a, la), (_b, lb) in zip(lengths, lengths[1:]):
        assert la <= lb + 1e-9
    ticks = axis.ticks()
    assert ticks[0][1] == 0 and all(x <= width + 1e-9 for _, x, _ in ticks)


names = st.text(alphabet="abcxyz_.<>&'\"0123456789", min_size=1, max_size=24)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(names, values, values, values), min_size=1, max_size=8, unique_by=lambda t: t[0]))
def test_any_op_chart_keeps_its_labels_apart(ops):
    kinds = ["bf16", "fp32", "promote", None]
    rows = [
        op_row(name, own, loss, list=kinds[i % 4], max_rel=0.0, mean_rel=0.0, fp32_ms=ms, lists_ms=ms)
        for i, (name, own, loss, ms) in enumerate(ops)
    ]
    for r in rows:  # an error is never None: audit measures one for every row
        r["own_max_rel"] = 0.0 if r["own_max_rel"] is None else r["own_max_rel"]
        r["loss_error"] = 0.0 if r["loss_error"] is None else r["loss_error"]
    svg = svgs(report.render(audit=AuditReport(rows, 0.0, 0.05, 2e-3)))["ops"]
    assert sorted(labels(svg)) == sorted(name for name, *_ in ops)
    assert_no_overlaps(svg)


# --- verdict first, and no section contradicting another -----------------------------------------------------


def hand_tune(audit, validation, samples, module_proposals=None):
    from hmp.tools.tune_result import TuneResult

    lists = {"bf16": ["linear"], "fp32": [], "promote": []}
    timings = {name: sorted(s)[len(s) // 2] for name, s in samples.items()}
    return TuneResult(lists, lists, audit, {}, validation, timings, samples=samples, module_proposals=module_proposals)


def section(page, start, end):
    return html.unescape(page[page.index(start) : page.index(end)])


def test_outside_the_tolerance_with_no_op_flagged_says_why_not_none():
    audit = AuditReport([op_row("linear", 0.01, 1e-4)], 0.03, 0.05, 2e-3)
    fp32 = [1.0, 1.1, 0.9, 1.0]
    tune = hand_tune(
        audit,
        {"fp32": 1.0, "starting lists": 1.05, "tuned lists": 1.05},
        {"fp32": fp32, "starting lists": fp32, "tuned lists": [t * 0.5 for t in fp32]},
    )
    page = report.render(tune=tune)
    verdict = section(page, 'id="verdict"', 'id="todo"')
    assert "Outside the 2% tolerance" in verdict and "+5.00% from fp32's loss" in verdict
    assert "No op is over the thresholds alone" in verdict
    assert "Faster: a step under the tuned lists takes 0.50x fp32's time (middle half of 4 pairs: 0.50x to 0.50x)" in (
        verdict
    )
    # the summary names no op, and says so without a bare "none" that reads as "all is well"
    flagged = re.search(r"<dt>ops flagged</dt><dd>(.*?)</dd>", page).group(1)
    assert flagged.startswith("none alone")
    # the same ratio in the validation table and the summary as in the verdict
    assert page.count("0.50x (0.50-0.50)") == 2 and "outside tolerance (2%)" in page
    # then what to do, agreeing with the verdict: not "use them"
    todo = section(page, 'id="todo"', "The evidence")
    assert "Do not use the tuned lists as they are" in todo and "Use them" not in todo
    assert "result.write('tuned_bf16.txt', 'tuned_fp32.txt')" in todo and "hmp.convert(" not in todo


def test_a_measured_step_time_names_its_control_alike_in_every_sentence_of_the_tune_page():
    """A measurably slower step with its control (the starting lists timed twice): the verdict says the
    ratio in the words the tune verdict uses, and no sentence of the page names the control otherwise. The
    browser test meets this branch only where its machine's timing measures a difference."""
    from hmp.tools import speed, timing

    audit = AuditReport([op_row("linear", 0.01, 1e-4)], 0.001, 0.05, 2e-3)
    fp32 = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95]
    tune = hand_tune(
        audit,
        {"fp32": 1.0, "starting lists": 1.0, "tuned lists": 1.0},
        {"fp32": fp32, "starting lists": fp32, "tuned lists": [t * 1.8 for t in fp32]},
    )
    tune.control = timing.ratio(fp32, fp32, timed="the starting lists")  # named where tune makes it
    ratio = tune.ratio("tuned lists")
    assert ratio.measurable and ratio.slower and ratio.control is not None
    page = html.unescape(report.render(tune=tune))
    verdict = section(page, 'id="verdict"', 'id="todo"')
    assert speed.words(ratio) in verdict
    said = re.findall(r"(\w+ \w+ \w+)(?: are)? timed twice", page)
    assert len(said) >= 3 and {s.lower() for s in said} == {"the starting lists"}, said


def test_the_module_class_table_lists_only_classes_that_make_too_much_error():
    audit = AuditReport([op_row("linear", 0.01, 1e-4)], 0.001, 0.05, 2e-3)
    proposals = {
        name: {"class": name, "type": torch.nn.Linear, "made_max_rel": made, "loss_error": 0.0, "nonfinite": 0}
        | {"accepted": made > 0.05}
        for name, made in (("a.Over", 0.3), ("b.Quiet", 0.0))
    }
    fp32 = [1.0, 1.0, 1.0]
    samples = {"fp32": fp32, "starting lists": fp32, "tuned lists": fp32}
    tune = hand_tune(audit, {"fp32": 1.0, "starting lists": 1.0, "tuned lists": 1.0}, samples, proposals)
    page = report.render(tune=tune)
    heading = "Module classes whose own code makes too much error"
    table_html = page[page.index(heading) : page.index("</table>", page.index(heading))]
    assert "a.Over" in table_html and "b.Quiet" not in table_html
    assert "so left as they are: b.Quiet" in page
    assert "| b.Quiet |" not in tune.table() and "| a.Over |" in tune.table()
    assert "Speed: no measurable difference between" in section(page, 'id="verdict"', 'id="todo"')


def test_the_audit_page_leads_with_its_verdict(audited):
    page = report.render(audit=audited)
    assert page.index('id="verdict"') < page.index('id="todo"') < page.index("The evidence") < page.index("<svg")
    verdict = section(page, 'id="verdict"', 'id="todo"')
    assert ("Nothing flagged" in verdict) == (not audited.flagged and not audited.flagged_modules)
    assert "the listed ops' forward time under the lists" in verdict
    assert audited.time_ratio is not None and audited.time_ratio.load.taken == TIMED_PAIRS


def test_what_to_do_agrees_with_the_verdict_and_says_why_each_change_is_there():
    """No change: nothing to do (never "use them"); changes within the tolerance: each with its
    reason, then the call that loads them; outside it: do not use them as they are."""
    audit = AuditReport([op_row("linear", 0.01, 1e-4), op_row("sub", 0.3, 0.01)], 0.001, 0.05, 2e-3)
    audit.rows[1].update(flagged=True, reason="error 0.3 > 0.05")
    fp32 = [1.0, 1.0, 1.0]
    samples = {"fp32": fp32, "starting lists": fp32, "tuned lists": fp32}
    same = hand_tune(audit, {"fp32": 1.0, "starting lists": 1.0, "tuned lists": 1.0}, samples)
    todo = section(report.render(tune=same), 'id="todo"', "The evidence")
    assert "Nothing to change" in todo and "Use them" not in todo and "hmp.convert(" not in todo

    moved = hand_tune(audit, {"fp32": 1.0, "starting lists": 1.0, "tuned lists": 1.0}, samples)
    moved.lists = {"bf16": ["linear", "tanh"], "fp32": ["sub"], "promote": []}
    moved.before = {"bf16": ["linear"], "fp32": [], "promote": []}
    kept = "kept: within the bounds, and a step with it takes 0.90x"
    moved.trials = {
        "tanh": {"was": None, "seconds": 1e-3, "own_max_rel": 0.01, "loss_error": 1e-4, "nonfinite": 0}
        | {"accepted": True, "outcome": "kept: step 0.90x", "why": kept}
    }
    page = report.render(tune=moved)
    verdict, todo = section(page, 'id="verdict"', 'id="todo"'), section(page, 'id="todo"', "The evidence")
    assert "Within the 2% tolerance" in verdict and "2 changes from the starting lists" in todo
    assert "sub to the FP32 list: flagged by the audit (error 0.3 > 0.05)" in todo
    assert "tanh to the BF16 list: within the bounds, and a step with it takes 0.90x" in todo
    assert todo.index("Use them") < todo.index("hmp.convert(bf16_file_path='tuned_bf16.txt'")

    outside = hand_tune(audit, {"fp32": 1.0, "starting lists": 1.05, "tuned lists": 1.05}, samples)
    outside.lists, outside.before = moved.lists, moved.before
    outside.trials = moved.trials
    page = report.render(tune=outside)
    verdict, todo = section(page, 'id="verdict"', 'id="todo"'), section(page, 'id="todo"', "The evidence")
    assert "Outside the 2% tolerance" in verdict and "Do not use the tuned lists as they are" in todo
    assert "sub to the FP32 list" in todo and "Use them" not in todo
