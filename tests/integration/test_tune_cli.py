"""``python -m hmp tune TARGET`` on a user's own training step: loading the
target, its errors, progress on stderr, the verdict, identical lists flagged,
and the timing spread against an independent computation."""

import json
import re
import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import hmp
from hmp.__main__ import main
from hmp.tools.tuning import TuneResult

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

MODEL = textwrap.dedent("""
    import torch

    def make_step():
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))

        def step():
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss

        return step, (model, opt)

    def not_a_pair():
        return 3

    def forward_only():
        model = torch.nn.Linear(16, 4)
        x = torch.randn(64, 16)
        return (lambda: model(x)), (model,)  # logits, no backward, no optimizer step

    def no_state():
        step, _ = make_step()
        return step, ()
""")

FAST = ["--steps", "3", "--rounds", "2"]


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's folder holding mymodel.py, as the working directory."""
    (tmp_path / "mymodel.py").write_text(MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("form", ["mymodel:make_step", "mymodel.py:make_step"])
def test_tune_runs_the_users_step_and_writes_lists_and_json(project, form, capsys):
    out = project / "out.json"
    assert main(["tune", form, *FAST, "--json", str(out)]) == 0
    captured = capsys.readouterr()
    for name in ("tuned_bf16.txt", "tuned_fp32.txt"):
        assert (project / name).read_text().startswith("# written by hmp.tune")
    res = json.loads(out.read_text())
    assert set(res["validation"]) == {"fp32", "starting lists", "tuned lists"}
    # the lists written load again
    with hmp.converted(bf16_file_path=str(project / "tuned_bf16.txt"), fp32_file_path=str(project / "tuned_fp32.txt")):
        assert hmp.effective_lists()["bf16"] == res["lists"]["bf16"]
    # progress on stderr, counted in runs of the step: a line at the start, one every 10 s, and the end
    err = captured.err.splitlines()
    assert err[0] == "python -m hmp tune: tuning: counting runs"
    assert re.fullmatch(r"python -m hmp tune: tuned in \d+ s \((\d+) runs of the step\)", err[-1])
    # the verdict, against the numbers it names
    gap = (res["validation"]["tuned lists"] - res["validation"]["fp32"]) / abs(res["validation"]["fp32"])
    assert res["verdict"] in captured.out
    assert f"{gap:+.2%} from fp32's loss" in res["verdict"]
    # judged over the last half of the validation steps (each step's loss, in the JSON): within or
    # outside only where every one of them agrees, else it cannot tell yet
    ref, mine = res["loss_per_step"]["fp32"], res["loss_per_step"]["tuned lists"]
    gaps = [abs(b - a) / abs(a) for a, b in list(zip(ref, mine))[len(mine) // 2 :]]
    word = "within" if max(gaps) <= 0.02 else "OUTSIDE" if min(gaps) > 0.02 else "CANNOT TELL YET against"
    assert f"{word} the 2% tolerance" in res["verdict"]
    assert all(len(times) == 2 * 2 for times in res["step_times"].values())  # 2 timed steps per round


def _shipped_module_entries(kind):
    """The module entries (dotted lines) the shipped default list of ``kind`` names, read from its file."""
    lines = (line.split("#", 1)[0].strip() for line in hmp.list_path(kind).read_text().splitlines())
    return [line for line in lines if "." in line and not line.startswith(("-", "include"))]


def test_tuned_files_extend_the_defaults_and_keep_their_module_patterns(project):
    assert _shipped_module_entries("fp32")  # the rotary and timestep patterns this is about
    assert main(["tune", "mymodel:make_step", *FAST]) == 0
    paths = {kind: project / f"tuned_{kind}.txt" for kind in ("bf16", "fp32")}
    for path in paths.values():
        text = path.read_text()
        lines = [line for line in text.splitlines() if not line.startswith("#")]
        assert lines[0] == "include default", text
        assert "extends the default" in text and "module instances" not in text
    with hmp.converted(bf16_file_path=str(paths["bf16"]), fp32_file_path=str(paths["fp32"])):
        loaded = hmp.effective_lists()
    for kind in paths:
        assert sorted(entry for entry in loaded[kind] if "." in entry) == sorted(_shipped_module_entries(kind))


def test_identical_lists_are_flagged_as_noise(project, capsys):
    out = project / "out.json"
    assert main(["tune", "mymodel:make_step", *FAST, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    stdout = capsys.readouterr().out
    with hmp.converted():
        default = {
            kind: [name for name in names if "." not in name]  # ops; module patterns are apart
            for kind, names in hmp.effective_lists().items()
        }
    unchanged = res["lists"] == default and not res["modules_to_fp32"]
    assert unchanged  # nothing to tune on this small model at the default bounds
    assert res["same_as"] == {"tuned lists": "starting lists"}
    assert "tuned lists (same lists as starting lists)" in stdout
    assert "timing noise: tuned lists = starting lists" in stdout


@pytest.mark.parametrize(
    "target, message",
    [
        ("nomodule:make_step", "no module 'nomodule'"),
        ("mymodel.py:nothere", "/mymodel.py' has no function 'nothere'"),  # the file by its absolute path
        ("mymodel", "expected MODULE:FUNCTION or FILE.py:FUNCTION"),
        ("missing/file.py:make_step", "/missing/file.py'"),
        ("mymodel:not_a_pair", "not_a_pair() must return (step, state)"),
        ("mymodel:no_state", "no_state() returned an empty state: it must hold the modules and optimizers"),
    ],
)
def test_a_bad_target_is_a_clear_error_and_writes_nothing(project, target, message, capsys):
    assert main(["tune", target]) == 2
    err = capsys.readouterr().err
    assert f"python -m hmp tune: error: TARGET {target!r}" in err and message in err
    assert "Traceback" not in err
    assert not (project / "tuned_bf16.txt").exists()
    assert not hmp.is_converted()


def test_a_step_that_does_not_train_is_said_plainly(project, capsys):
    assert main(["tune", "mymodel:forward_only", *FAST]) == 1
    err = capsys.readouterr().err
    assert "python -m hmp tune: error: TARGET 'mymodel:forward_only': the step's loss did not move over 3" in err
    assert "so it does not train" in err and "loss.backward() and optimizer.step()" in err
    assert "Traceback" not in err and "within" not in err
    assert not (project / "tuned_bf16.txt").exists()


def test_output_defaults_are_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--bf16-out BF16_OUT where to write the BF16 list (default tuned_bf16.txt)" in text
    assert "--fp32-out FP32_OUT where to write the FP32 list (default tuned_fp32.txt)" in text


def test_every_option_has_help(capsys):
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    text = capsys.readouterr().out
    for flag in ("--steps", "--rounds", "--tolerance", "--seed", "--batch-size", "--report", "--json"):
        after = text.split(flag, 1)[1].split("\n  -", 1)[0]
        assert len(after.split()) > 2, f"{flag} has no help text"


def _result(samples, validation, tolerance=0.02):
    return TuneResult(
        {"bf16": [], "fp32": [], "promote": []},
        {"bf16": [], "fp32": [], "promote": []},
        None,
        {},
        validation,
        {n: float(np.median(s)) for n, s in samples.items()},
        samples=samples,
        tolerance=tolerance,
    )


@given(st.lists(st.floats(1e-4, 10.0), min_size=4, max_size=40))
def test_spread_is_the_interquartile_range_over_the_median(times):
    result = _result({"fp32": times}, {"fp32": 1.0})
    q1, q3 = np.percentile(times, [25, 75], method="weibull")  # the n+1 quantile method, as statistics.quantiles
    assert result.spread("fp32") == pytest.approx((q3 - q1) / np.median(times), rel=1e-9, abs=1e-12)


@given(fp32=st.floats(0.1, 10.0), tuned=st.floats(0.1, 10.0), tolerance=st.sampled_from([0.01, 0.02, 0.05]))
def test_verdict_says_within_exactly_when_the_gap_is_inside_the_tolerance(fp32, tuned, tolerance):
    result = _result({}, {"fp32": fp32, "starting lists": fp32, "tuned lists": tuned}, tolerance)
    gap = abs(tuned - fp32) / fp32
    assert ("within" in result.verdict) == (gap <= tolerance)
    assert ("OUTSIDE" in result.verdict) == (gap > tolerance)


def test_pairs_that_straddle_one_are_said_to_be_noise():
    fp32 = [1.0, 1.2, 0.8, 1.1, 0.9, 1.0]
    # the same times in another order: each pair's ratio is above or below 1 by chance
    result = _result(
        {"fp32": fp32, "tuned lists": [1.1, 0.9, 1.0, 1.2, 0.8, 1.0]},
        {"fp32": 1.0, "starting lists": 1.0, "tuned lists": 1.0},
    )
    said = "step time: no measurable difference (middle half of 6 pairs: "  # the range said, covering 1
    assert said in result.verdict and "x fp32's time" not in result.verdict
    assert result.time_cell("tuned lists").startswith("no measurable difference (")
    far = _result(
        {"fp32": fp32, "tuned lists": [t * 3 for t in fp32]}, {"fp32": 1.0, "starting lists": 1.0, "tuned lists": 1.0}
    )
    assert "step time: 3.00x fp32's time (middle half of 6 pairs: 3.00x to 3.00x)" in far.verdict
    assert "no measurable difference" not in far.verdict
    assert far.time_cell("tuned lists") == "3.00x (3.00-3.00)" and far.time_cell("fp32") == "1 (reference)"


def test_the_shipped_example_tunes_from_the_command_line_and_draws_its_report(tmp_path, monkeypatch, capsys):
    """examples/tune_my_model.py plants a linear layer on raw readings that bf16 spoils: moved, page drawn."""
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "tune_my_model.py"
    monkeypatch.chdir(tmp_path)
    assert main(["tune", f"{example}:make_step", *FAST, "--report", "tune.html"]) == 0
    out = capsys.readouterr().out
    assert "moved to FP32: linear" in out and "verdict: " in out
    page = (tmp_path / "tune.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and ">linear<" in page
    # the example's class as a list file names it (the file's own name), not a prefixed module's
    assert "tune_my_model.Recentered" in page and "_hmp_tune_target_" not in page + out
    assert page.index('id="verdict"') < page.index("hmp.convert(bf16_file_path=") < page.index("<svg")


def test_a_zero_fp32_loss_gives_a_verdict_not_a_division_error():
    same = _result({}, {"fp32": 0.0, "starting lists": 0.0, "tuned lists": 0.0})
    assert same.loss_gap("tuned lists") == 0.0 and "within the 2% tolerance" in same.verdict
    apart = _result({}, {"fp32": 0.0, "starting lists": 0.1, "tuned lists": 0.1})
    assert apart.loss_gap("tuned lists") == float("inf") and "OUTSIDE" in apart.verdict
    from hmp.tools.report.page import validation_table

    assert "outside tolerance (2%)" in validation_table(apart)


def test_a_class_from_a_file_target_is_written_by_a_path_a_fresh_process_loads(tmp_path, monkeypatch):
    """A FILE.py target is imported under its own name, so a tuned list file
    names its classes by a path that loads again from that folder."""
    import sys

    from helpers import run_python

    from hmp.tools import target, tuned_files

    (tmp_path / "planted_model.py").write_text(
        "import torch\n\nclass Scale(torch.nn.Module):\n    def forward(self, x):\n        return x\n\n"
        "def make():\n    return Scale\n"
    )
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "json.py").write_text("def make():\n    class Local: pass\n    return Local\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_target puts each file's folder first
    cls = target.load_target(str(tmp_path / "planted_model.py") + ":make")()
    assert tuned_files.importable(cls) == "planted_model.Scale"
    assert target.user_name(cls) == "planted_model.Scale"  # shown as a list file names it
    load = "from hmp.binding.module_entries import module_class; print(module_class('planted_model.Scale'))"
    fresh = run_python("-c", load, cwd=tmp_path)
    assert fresh.returncode == 0 and "planted_model.Scale" in fresh.stdout, fresh.stderr
    # a file named like a module the process has (the stdlib's json) keeps clear of it
    fn = target.load_target(str(tmp_path / "other" / "json.py") + ":make")
    assert fn.__module__ == target.PREFIX + "json" and target.user_name(fn()) == "json.py:make.<locals>.Local"
    import json

    assert hasattr(json, "dumps")
