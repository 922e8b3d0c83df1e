"""Every sentence of tune's and audit's verdict and "what to do" follows from
the numbers on the same page (hmp/tools/sentences.py): each test here feeds
recorded data with known numbers, no live run of a model, and checks the
sentences. A speed or loss verdict only where its interval lies wholly on
one side of its threshold, else "cannot tell yet" with how much longer to
run; an op's time never more than the step it was measured in; the files
described from their lines; the audit's headline from the same runs and op
set as its rows; one progress bar that only moves forward; and every list
file tune writes loads in hmp.convert(), also where diffusers (whose module
classes the default FP32 list names) is not installed."""

import html
import importlib.util
import os
import subprocess
import sys
import time

import pytest
import torch
from helpers import op_row

import hmp
from hmp.binding import kinds
from hmp.tools import host, op_costs, progress, sentences, speed, tuned_files
from hmp.tools.audit_report import AuditReport
from hmp.tools.record import OpStats
from hmp.tools.report import page as report
from hmp.tools.timing import Ratio
from hmp.tools.tune_result import TuneResult


def row(op, own=0.01, loss=1e-4, **fields):
    return op_row(op, own, loss, **{"time_ratio": None, **fields})


def recorded(trajectories, samples=None, lists=None, before=None, steps=20, rounds=5):
    """A TuneResult as tune records it, from known numbers: each configuration's loss after each
    validation step, its step times (interleaved with fp32's), the lists and the starting lists."""
    audit = AuditReport([row("linear")], 0.001, 0.05, 2e-3)
    lists = lists or {"bf16": ["linear"], "fp32": [], "promote": []}
    before = before or lists
    samples = samples or {name: [1.0, 1.0, 1.0, 1.0] for name in trajectories}
    validation = {name: losses[-1] for name, losses in trajectories.items()}
    timings = {name: sorted(s)[len(s) // 2] for name, s in samples.items()}
    result = TuneResult(lists, before, audit, {}, validation, timings, samples=samples)
    result.trajectories, result.steps, result.rounds = trajectories, steps, rounds
    return result


def section(page, start, end):
    return html.unescape(page[page.index(start) : page.index(end)])


def verdict_and_todo(result):
    page = report.render(tune=result)
    return page, section(page, 'id="verdict"', 'id="todo"'), section(page, 'id="todo"', "The evidence")


# --- speed: a verdict only where the middle half excludes 1.0 ---------------------------------------------------


@pytest.mark.parametrize(
    "ratio, said",
    [
        (Ratio(0.93, 0.90, 0.96, 10, 9), "Faster: a step takes 0.93x fp32's time (middle half of 10 pairs: 0.90x"),
        (Ratio(1.10, 1.05, 1.20, 10, 0), "Slower: a step takes 1.10x fp32's time (middle half of 10 pairs: 1.05x"),
        (Ratio(0.97, 0.92, 1.03, 10, 6), "cannot tell yet whether it is faster or slower; run longer (--rounds 10)"),
        (Ratio(0.50, 0.40, 0.60, 2, 2), "cannot tell yet"),  # too few pairs, however far from 1
    ],
)
def test_a_speed_verdict_only_where_its_interval_excludes_1(ratio, said):
    sentence = speed.speed_sentence(ratio, "a step", speed.more_rounds(5))
    assert said in sentence
    if not (ratio.pairs >= 3 and (ratio.high < 1 or ratio.low > 1)):
        assert "Faster" not in sentence and "Slower" not in sentence


# --- loss: within, outside, or cannot tell yet ----------------------------------------------------------------


def losses(final_gaps, fp32=1.0, steps=20):
    """fp32's loss held at ``fp32``; the tuned lists' ``final_gaps`` (relative) over the last steps."""
    ref = [fp32] * steps
    tuned = [fp32] * (steps - len(final_gaps)) + [fp32 * (1 + g) for g in final_gaps]
    return {"fp32": ref, "starting lists": ref, "tuned lists": tuned}


def test_a_loss_gap_that_crosses_the_tolerance_is_not_a_verdict():
    """The user's CNN: +10.25% at the last of 20 steps, within 2% at some of the ten before it: red
    "do not use" was a guess; the page says it cannot tell yet and to run 40 steps."""
    result = recorded(losses([0.01, -0.015, 0.03, 0.005, 0.08, 0.012, 0.04, 0.019, 0.06, 0.1025]))
    page, verdict, todo = verdict_and_todo(result)
    assert result.loss_state() == sentences.UNKNOWN and not result.within
    assert "Cannot tell yet whether the tuned lists stay within the 2% tolerance" in verdict
    assert "+10.25% from fp32's loss, and -1.50% to +10.25% over the last 10 of 20 steps" in verdict
    assert "run longer (--steps 40)" in verdict
    assert "Do not use" not in todo and "Use them" not in todo and "--steps 40" in todo
    assert 'class="verdict unsure"' in page
    assert "CANNOT TELL YET" in result.verdict and "--steps 40" in result.verdict


def test_every_step_outside_is_outside_and_every_step_within_is_within():
    outside = recorded(losses([0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.1, 0.1, 0.1, 0.1025]))
    page, verdict, todo = verdict_and_todo(outside)
    assert "Outside the 2% tolerance" in verdict and "Do not use the tuned lists as they are" in todo
    assert 'class="verdict bad"' in page and "OUTSIDE the 2% tolerance" in outside.verdict

    within = recorded(losses([0.001, -0.002, 0.003, 0.0, 0.01, -0.019, 0.0, 0.0, 0.0, 0.004]))
    page, verdict, todo = verdict_and_todo(within)
    assert "Within the 2% tolerance" in verdict and "+0.40% from fp32's loss" in verdict
    assert 'class="verdict ok"' in page and "within the 2% tolerance" in within.verdict


def test_loss_gaps_are_the_last_half_of_the_steps_and_the_final_one_last():
    result = recorded(losses([0.5] * 3 + [0.01] * 10))  # early trouble, before the last half: not judged
    gaps = result.loss_gaps("tuned lists")
    assert len(gaps) == 10 and gaps[-1] == pytest.approx(result.loss_gap("tuned lists"))
    assert result.loss_state() == sentences.WITHIN


@pytest.mark.parametrize(
    "gaps, state",
    [
        ([0.0, 0.02], "within"),
        ([0.021, -0.5], "outside"),
        ([0.0, 0.03], "cannot tell yet"),
        ([float("nan")], "outside"),
    ],
)
def test_loss_state(gaps, state):
    assert sentences.loss_state(gaps, 0.02) == state


# --- the files: described from their lines ----------------------------------------------------------------------


def test_the_files_are_described_by_their_lines_the_users_own_and_tunes(tmp_path):
    """The starting lists held a line of the user's (tanh in BF16, not in the default); tune moved
    sub to FP32. The page never says "nothing else"; the file puts each line under whose it is."""
    default = {k.name: sorted(tuned_files.default_entries(k).ops) for k in kinds.KINDS}
    before = {**default, "bf16": sorted({*default["bf16"], "tanh"})}
    mine = recorded(losses([0.0] * 10), lists=before, before=before)
    mine.modules = {k: tuple(tuned_files.default_entries(kinds.kind(k)).modules) for k in mine.modules}
    mine.start_modules = mine.modules
    parts = mine.file_parts()
    assert "tanh" in parts["bf16"]["start"] and "tanh" not in parts["bf16"]["tune"]
    assert parts["fp32"] == {"start": [], "tune": []}
    _, _, todo = verdict_and_todo(mine)
    assert "Nothing to change" in todo and "nothing else" not in todo.split("tuned_fp32.txt")[0]
    assert "tuned_bf16.txt: include default, then" in todo and "of the lists you started from" in todo
    assert "tuned_fp32.txt: include default and nothing else" in todo

    tuned = {**before, "fp32": sorted({*default["fp32"], "sub"})}
    moved = recorded(losses([0.0] * 10), lists=tuned)
    moved.before, moved.modules, moved.start_modules = before, mine.modules, mine.modules
    bf16, fp32 = tmp_path / "b.txt", tmp_path / "f.txt"
    moved.write(bf16, fp32)
    text = fp32.read_text()
    body = text.split("include default\n", 1)[1]
    assert body.startswith(tuned_files.FROM_TUNE) and "sub" in body and tuned_files.FROM_START not in body
    bf16_body = bf16.read_text().split("include default\n", 1)[1]
    assert bf16_body.startswith(tuned_files.FROM_START) and tuned_files.FROM_TUNE not in bf16_body
    _, _, todo = verdict_and_todo(moved)
    assert "b.txt: include default, then 1 line of the lists you started from" in todo
    assert "f.txt: include default, then 1 of tune's (" in todo


def tiny_step():
    """A tiny model's training step and the state tune and audit restore between runs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))

    def step():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step, (model, opt)


def tiny_tune():
    """A real tune, of a tiny model for two validation steps: the files its own writer writes."""
    step, state = tiny_step()
    result = hmp.tune(step, state=state, steps=2, rounds=2, progress=False)
    assert len(result.trajectories["tuned lists"]) == 2  # each validation step's loss, on record
    return result


def without_patterns():
    """Starting lists without the shipped module patterns: the FP32 file takes them out by name."""
    return recorded(losses([0.0] * 10), lists={"bf16": ["linear"], "fp32": ["sub"], "promote": []})


@pytest.mark.parametrize("made", [without_patterns, tiny_tune])
def test_every_file_tune_writes_loads_where_diffusers_is_not_installed(tmp_path, made):
    """convert() must load what tune writes, ``-diffusers.models.embeddings.Timesteps`` lines
    included, with no diffusers to import."""
    result = made()
    bf16, fp32 = tmp_path / "tuned_bf16.txt", tmp_path / "tuned_fp32.txt"
    result.write(bf16, fp32)
    if made is without_patterns:
        assert "-diffusers.models.embeddings.Timesteps" in fp32.read_text()
    if importlib.util.find_spec("diffusers") is not None:
        pytest.skip("diffusers is installed here: this check needs an environment without it")
    probe = (
        "import importlib.util\n"
        "assert importlib.util.find_spec('diffusers') is None\n"
        "import hmp\n"
        f"hmp.convert(bf16_file_path={str(bf16)!r}, fp32_file_path={str(fp32)!r})\n"
        "print('loaded')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]


# --- an op's time is a part of the step it was measured in ------------------------------------------------------


def test_an_ops_time_is_never_more_than_the_step_it_was_measured_in():
    a = torch.randn(64, 64)

    def run():
        for _ in range(5):
            torch.mm(a, a)
        time.sleep(0.002)  # the rest of a step: the backward, the optimizer

    costs = op_costs.measure(run, [], runs=3)
    assert costs.seconds["mm"] <= costs.step_seconds and sum(costs.seconds.values()) <= costs.step_seconds
    assert 0 < costs.of_step("mm") <= 1
    trial = {"seconds": 0.236, "step_seconds": 0.300}
    assert speed.op_share(trial) == "78.7% of its step"  # a share: the page states one step time


# --- audit: the headline and the rows from the same runs and ops ------------------------------------------------


def stats(**ms):
    return {op: OpStats(calls=1, op_seconds=v / 1e3) for op, v in ms.items()}


def test_the_audits_headline_comes_from_its_rows_runs_and_op_set():
    """batch_norm, in no list, recorded under the lists only (5 ms there, nothing in fp32): counted on
    one side it made the headline 1.89x where the rows say 1.1x to 1.2x; it is in neither now."""
    fp32_run, lists_run = stats(conv2d=2.0, linear=1.0), stats(conv2d=2.2, linear=1.2, batch_norm=5.0)
    ticks = iter(range(10**6))  # a quiet machine: a clock that moves 1 s a read, no waits, no steal
    quiet = host.Host(lambda: float(next(ticks)), lambda: 0.0, lambda: 0.0, lambda: (0.0, 1))
    rows_times, total = op_costs.op_times(lambda fp32: fp32_run if fp32 else lists_run, host=quiet)
    assert rows_times["batch_norm"]["time_ratio"] is None and rows_times["batch_norm"]["fp32_ms"] is None
    assert rows_times["conv2d"]["time_ratio"].median == pytest.approx(1.1)
    assert rows_times["linear"]["time_ratio"].median == pytest.approx(1.2)
    assert total.median == pytest.approx(3.4 / 3.0)  # the timed rows' sums: between their ratios
    rows = [row(op, **times) for op, times in rows_times.items()]
    audit = AuditReport(rows, 0.001, 0.05, 2e-3, time_ratio=total)
    verdict = section(report.render(audit=audit), 'id="verdict"', 'id="todo"')
    assert "Slower: the listed ops' forward time under the lists (conv2d, linear: the ops timed in both)" in verdict
    assert "1.13x fp32's time" in verdict and "batch_norm" not in verdict


# --- one progress bar that only moves forward -------------------------------------------------------------------


class FakeBar:
    def __init__(self, total, **options):
        self.total, self.n, self.seen = total, 0, []

    def set_postfix_str(self, text, refresh=True):
        self.postfix = text

    def update(self, n):
        self.n += n
        self.seen.append(self.n)

    def write(self, line, file=None):
        pass

    def close(self):
        pass


class Terminal:
    def isatty(self):
        return True

    def write(self, text):
        pass

    def flush(self):
        pass


def test_one_bar_over_all_phases_only_moves_forward_and_ends_full(monkeypatch):
    monkeypatch.setattr(progress, "tqdm", FakeBar)
    monkeypatch.setattr(progress.sys, "stderr", Terminal())
    runs = progress.StepRuns("hmp.tune", None, label="tuning")
    fn = runs.counted(lambda: None)
    for phase, n in (
        ("audit", 5),
        ("trials", 8),
        ("validation", 6),
        ("timing", 30),
    ):  # each phase ends at done == total
        runs.expect(n, phase)
        for _ in range(n):
            fn()
    bar = runs.bar.bar
    assert bar.seen == sorted(bar.seen) and max(bar.seen) < progress.SCALE  # forward, short of 100% while running
    assert bar.postfix.startswith("run 49/49")
    runs.close("tuned")
    assert bar.n == progress.SCALE


def test_forward_never_falls_when_the_total_grows():
    shown = 0.0
    for done, total in ((5, 5), (6, 13), (13, 13), (14, 19), (19, 49), (37, 100)):
        new = progress.forward(shown, done, total)
        assert shown <= new <= progress.SHORT_OF_ALL
        shown = new


def test_nothing_to_change_does_not_claim_the_lists_suit_a_step_they_slow_down():
    fp32 = [1.0, 1.1, 0.9, 1.0]
    samples = {"fp32": fp32, "starting lists": [2 * t for t in fp32], "tuned lists": [2 * t for t in fp32]}
    result = recorded(losses([0.0] * 10), samples=samples)
    _, verdict, todo = verdict_and_todo(result)
    assert "Slower: a step under the tuned lists takes 2.00x fp32's time" in verdict
    assert "Nothing to change in the lists" in todo and "suit" not in todo
    assert "takes 2.00x fp32's time (middle half of 4 pairs: 2.00x to 2.00x): fp32 without hmp is faster here" in todo


def test_an_audits_op_times_are_parts_of_the_step_of_the_same_runs():
    step, state = tiny_step()
    audit = hmp.audit(step, state=state, progress=False)
    timed = [r for r in audit.rows if r["fp32_ms"] is not None]
    assert timed and all(r["fp32_ms"] <= audit.step_ms["fp32"] for r in timed)
    assert all(r["lists_ms"] <= audit.step_ms["lists"] for r in audit.rows if r["lists_ms"] is not None)
    assert "The whole step in those runs: " in html.unescape(report.render(audit=audit))


def test_stalls_on_different_calls_in_different_runs_do_not_make_an_op_longer_than_the_step(monkeypatch):
    """Two calls of sin a step, three runs; a 9 ms stall on the first call in runs 1 and 2 and on the
    second in runs 2 and 3: each call's median is 10 ms, their sum 20 ms, while the step of the same
    runs took 14 ms (median). The op's time is its median total, 11 ms: never more than the step."""
    x = torch.randn(4, 8)

    class Clock:
        now, reads = 0.0, 0

        def perf_counter(self):
            # readings: the warm-up 1-4; each timed run its start, 2 per call, its end (5-10, 11-16, 17-22)
            self.reads += 1
            self.now += 1e-3 + (9e-3 if self.reads in (7, 13, 15, 21) else 0.0)
            return self.now

    def run():
        torch.sin(x)
        torch.sin(x)

    monkeypatch.setattr(op_costs, "time", Clock())
    costs = op_costs.measure(run, [], runs=3)
    assert op_costs.time.reads == 22
    assert costs.step_seconds == pytest.approx(14e-3)
    assert costs.seconds == {"sin": pytest.approx(11e-3)}  # not the 20 ms of the calls' medians summed
