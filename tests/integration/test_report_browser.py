"""The HTML reports in a real browser: headless Chromium at 1280x900 lays out
a page from a real tune and a real audit run; the verdict is on the first
screen and nothing makes the page scroll sideways.

The page has no scripts; the test measures a copy with one added, which
writes the layout into the title that ``--dump-dom`` prints. Skipped
without a Chromium binary, unless HMP_REQUIRE_BROWSER=1 (CI's newest leg,
where it is installed), which makes a missing browser a failure."""

import html
import json
import os
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

import hmp
from hmp.tools import speed

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

WIDTH, HEIGHT = 1280, 900
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

MEASURE = """
<script>
(function () {
  var verdict = document.getElementById("verdict").getBoundingClientRect();
  var todo = document.getElementById("todo").getBoundingClientRect();
  // every element that would scroll sideways on its own: content wider than its box
  var inner = [];
  document.querySelectorAll("body *").forEach(function (e) {
    var overflow = getComputedStyle(e).overflowX;
    if (overflow !== "visible" && e.scrollWidth > e.clientWidth + 1) {
      inner.push([e.tagName, e.className && e.className.baseVal !== undefined ? e.className.baseVal : e.className,
                  e.scrollWidth, e.clientWidth]);
    }
  });
  // every chart's drawn box against the box that holds it
  var charts = [];
  document.querySelectorAll("svg[role=img]").forEach(function (s) {
    var r = s.getBoundingClientRect(), p = s.parentElement.getBoundingClientRect();
    charts.push([s.getAttribute("class"), r.left, r.right, p.left, p.right, r.width, +s.getAttribute("width")]);
  });
  // the loss curves: each line's name and box, and the box of the chart that holds them
  var curves = [], plot = document.querySelector("svg.losses");
  document.querySelectorAll("svg.losses polyline").forEach(function (p) {
    var r = p.getBoundingClientRect();
    curves.push([p.getAttribute("data-name"), r.left, r.top, r.right, r.bottom]);
  });
  var box = plot ? plot.getBoundingClientRect() : null;
  document.title = JSON.stringify({
    curves: curves,
    lossBox: box ? [box.left, box.top, box.right, box.bottom] : null,
    innerWidth: window.innerWidth,
    innerHeight: window.innerHeight,
    scrollWidth: document.documentElement.scrollWidth,
    bodyScrollWidth: document.body.scrollWidth,
    verdict: [verdict.left, verdict.top, verdict.right, verdict.bottom],
    todo: [todo.left, todo.top, todo.right, todo.bottom],
    inner: inner,
    charts: charts
  });
})();
</script>
"""


def browser():
    found = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if found is None:
        if os.environ.get("HMP_REQUIRE_BROWSER") == "1":
            pytest.fail("HMP_REQUIRE_BROWSER=1 but no Chromium binary on PATH (" + ", ".join(BROWSERS) + ")")
        pytest.skip("no Chromium binary on PATH (set HMP_REQUIRE_BROWSER=1 to make this a failure)")
    return found


def layout(page, tmp_path):
    """The measured layout of ``page`` (HTML text) at WIDTHxHEIGHT."""
    measured = tmp_path / "measured.html"
    measured.write_text(page.replace("</body>", MEASURE + "</body>"))
    proc = subprocess.run(
        [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
        + [f"--window-size={WIDTH},{HEIGHT}", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom"]
        + [measured.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    title = re.search(r"<title>(\{.*?\})</title>", proc.stdout, re.S)
    assert title, f"chromium printed no measured title (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(title.group(1).replace("&quot;", '"'))


class AResidualProjectionBlockWhoseNameIsAsLongAsTheClassPathsOfLibrariesModelsTendToBeWhenTheyAreShownWhole(
    torch.nn.Sequential
):
    """A class path of 150-odd characters (a library's are 60-90): the module charts are wider than
    the page's box, so the page must scale them down, not hide them behind a scroll bar."""


class Wide(torch.nn.Module):
    """Enough modules that the page has charts, folded rows and a wide op chart."""

    def __init__(self):
        super().__init__()
        long = AResidualProjectionBlockWhoseNameIsAsLongAsTheClassPathsOfLibrariesModelsTendToBeWhenTheyAreShownWhole
        self.blocks = torch.nn.Sequential(*(long(torch.nn.Linear(16, 16), torch.nn.ReLU()) for _ in range(6)))
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.blocks(x))))


def problem():
    torch.manual_seed(0)
    model = Wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return step, (model, opt)


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pages")
    step, state = problem()
    try:
        tuned = hmp.tune(step, state=state, steps=3, rounds=2, min_share=0.0)
        audited = hmp.audit(step, state=state)
    finally:
        hmp.revert()
    tuned.write(folder / "tuned_bf16.txt", folder / "tuned_fp32.txt")
    tuned.save_html(folder / "tune.html")
    audited.save_html(folder / "audit.html")
    return {name: (folder / f"{name}.html").read_text() for name in ("tune", "audit")}, tuned


@pytest.mark.parametrize("name", ["tune", "audit"])
def test_the_verdict_is_on_the_first_screen_and_nothing_overflows(pages, name, tmp_path):
    page = pages[0][name]
    got = layout(page, tmp_path)
    assert got["innerWidth"] == WIDTH, got  # laid out at the width asked for
    assert got["scrollWidth"] <= WIDTH and got["bodyScrollWidth"] <= WIDTH, got
    # nothing hides behind a scroll bar of its own: every chart fits inside its box, scaled down if it must
    assert got["inner"] == [], got["inner"]
    assert got["charts"], "no chart was laid out"
    wider = [c for c in got["charts"] if c[6] > c[4] - c[3] + 1]
    assert wider, "no chart is wider than its box: the scaling goes untested"
    for cls, left, right, box_left, box_right, drawn, natural in got["charts"]:
        assert box_left - 1 <= left and right <= box_right + 1 and right <= WIDTH, (cls, got["charts"])
        assert drawn <= natural + 1, (cls, drawn, natural)  # scaled down to fit, never up
    left, top, right, bottom = got["verdict"]
    # the first screen: 900 px, or less where the headless window keeps some for itself
    assert 0 <= top < bottom <= min(HEIGHT, got["innerHeight"]) and 0 <= left < right <= WIDTH, got
    assert got["todo"][1] >= bottom, got  # what to do comes after the outcome
    # the page is ordered verdict, what to do, evidence
    assert page.index('id="verdict"') < page.index('id="todo"') < page.index("The evidence") < page.index("<svg")


def test_the_tune_page_says_what_the_verdict_and_the_table_say(pages, tmp_path):
    page, tuned = pages
    page = page["tune"]
    cell = tuned.time_cell("tuned lists")
    # the same ratio, from the same samples, in the verdict and the validation table
    verdict = html.unescape(page[page.index('id="verdict"') : page.index('id="todo"')])
    ratio = tuned.ratio("tuned lists")
    if ratio.measurable:
        assert speed.words(ratio) in verdict
    else:
        assert (speed.middle_half(ratio) if ratio.judged else speed.NOT_HERE) in verdict
    assert f'<td class="num">{cell}</td>' in page
    assert ("Within" in verdict) == tuned.within
    # what to do says what the verdict says: nothing to change, the changes and the call, or not to use them
    todo = html.unescape(page[page.index('id="todo"') : page.index("The evidence")])
    changed = tuned.moved_to_fp32 or tuned.added_to_bf16 or tuned.modules_to_fp32
    bf16, fp32 = tuned.written
    call = f"hmp.convert(bf16_file_path={bf16!r}, fp32_file_path={fp32!r})"
    if not tuned.within:
        assert "Do not use the tuned lists" in todo and call not in todo
    elif changed:
        assert "Use them" in todo and call in todo
    else:
        assert "Nothing to change" in todo and "Use them" not in todo and call not in todo


def test_the_tune_page_draws_a_loss_curve_per_configuration(pages, tmp_path):
    """The validation's loss after each step (tune.trajectories, in the JSON too), one line per
    configuration, each drawn inside the chart that holds it; the same lists' line dashed over the one it
    repeats, and named so in the legend."""
    page, tuned = pages
    got = layout(page["tune"], tmp_path)
    names = [name for name, *_ in got["curves"]]
    assert sorted(set(names)) == sorted(tuned.trajectories) and got["lossBox"], got["curves"]
    left, top, right, bottom = got["lossBox"]
    for name, x0, y0, x1, y1 in got["curves"]:
        assert left - 1 <= x0 <= x1 <= right + 1 and top - 1 <= y0 <= y1 <= bottom + 1, name
        assert x1 - x0 > 0.5 * (right - left), name  # across the steps, not a dot
    for name, earlier in tuned.same_as.items():
        assert f"{name} (same lists as {earlier})" in html.unescape(page["tune"])
