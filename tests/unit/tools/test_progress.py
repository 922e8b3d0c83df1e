"""Progress of long work (hmp/tools/progress.py): the tools count in runs of
the user's step, so the total they announce ends equal to the runs they made
and the time left tracks the work done; nothing shows for work that ends
within a few seconds."""

import pytest
import torch
import torch.nn.functional as F
from helpers import training_step

import hmp
from hmp.tools import progress

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def problem():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    step = training_step(model, opt, F.cross_entropy)
    runs = []

    def counted(*args):
        runs.append(1)
        return step(*args)

    return counted, runs, (model, opt), (x, y)


@pytest.mark.parametrize("tool", ["tune", "audit", "profile"])
def test_each_run_of_the_step_is_reported_once_and_the_total_ends_exact(tool):
    step, runs, state, batch = problem()
    seen = []
    report = lambda done, total, what: seen.append((done, total, what))  # noqa: E731
    if tool == "tune":
        hmp.tune(step, *batch, state=state, steps=2, rounds=2, min_share=0.0, progress=report)
    elif tool == "audit":
        hmp.audit(step, *batch, state=state, progress=report)
    else:
        with hmp.converted():
            hmp.profile(step, *batch, state=state, repeats=3, progress=report)
    assert [done for done, _, _ in seen] == list(range(1, len(runs) + 1))  # one report per run, none skipped
    assert all(total >= done for done, total, _ in seen)
    assert seen[-1][:2] == (len(runs), len(runs)) and all(what for _, _, what in seen)


class Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_plain_lines_start_after_the_delay_and_say_the_time_left_from_the_work_done(monkeypatch, capsys):
    clock = Clock()
    monkeypatch.setattr(progress, "time", clock)
    monkeypatch.setattr(progress, "tqdm", None)  # the plain lines a log gets
    bar = progress.Progress("tuning", 20, "tool", unit="run", every_s=10.0, delay_s=3.0)
    clock.now = 2.0
    bar.step("quick")  # 1 run in 2 s: under the delay, nothing
    assert capsys.readouterr().err == ""
    for i in range(2, 6):  # 2 s per run: 10 s for 5
        clock.now = 2.0 * i
        bar.step("audit")
    err = capsys.readouterr().err.splitlines()
    assert err == ["tool: tuning: 20 runs"]  # said once the delay passed, at 4 s
    clock.now = 14.0
    bar.step("trial", done=7)  # 10 s after the first line: 7 runs in 14 s, 13 left
    assert capsys.readouterr().err.strip() == "tool: tuning: run 7/20, trial, about 26 s left"
    clock.now = 20.0
    bar.step("trial", done=10)  # 6 s after that line: under every_s, nothing
    assert capsys.readouterr().err == ""
    bar.set_total(26)  # a phase learns it needs more: the next line says so, with the time left it means
    clock.now = 24.0
    bar.step("timing", done=12)  # 2 s a run, 14 left
    assert capsys.readouterr().err.strip() == "tool: tuning: run 12/26, timing, about 28 s left"
    bar.close("done")
    assert capsys.readouterr().err.strip() == "tool: done"


def test_work_that_ends_within_the_delay_says_nothing(monkeypatch, capsys):
    clock = Clock()
    monkeypatch.setattr(progress, "time", clock)
    monkeypatch.setattr(progress, "tqdm", None)
    runs = progress.StepRuns("hmp.audit", None, delay_s=3.0)
    fn = runs.counted(lambda: None)
    runs.expect(5, "audit")
    for i in range(5):
        clock.now = 0.5 * i
        fn()
    runs.close("audited")
    assert capsys.readouterr().err == "" and runs.done == 5


def test_tunes_time_left_counts_the_phases_still_to_come():
    """The total tune reports at each run counts the phases after the current one, as far as known: at its
    first run already the validation (3 configurations x steps) and the timing (fp32 and the starting lists
    twice, 2 x rounds pairs of two steps each), not the 3 runs of the first phase alone; from the validation
    on, every phase is known, so the total is the runs made to within one configuration's timing."""
    step, runs, state, batch = problem()
    seen = []
    report = lambda done, total, what: seen.append((done, total, what))  # noqa: E731
    steps, rounds = 2, 2
    hmp.tune(step, *batch, state=state, steps=steps, rounds=rounds, min_share=0.0, progress=report)
    timing = 2 * rounds * 2  # one configuration's pairs, two steps a sample
    assert seen[0][1] >= 3 + 3 * steps + 3 * timing, seen[0]
    validating = next(total for _, total, what in seen if what.startswith("validation"))
    assert len(runs) - steps <= validating <= len(runs) + timing, (validating, len(runs))
    assert seen[-1][:2] == (len(runs), len(runs))
