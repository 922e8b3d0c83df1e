"""``python -m hmp``'s subcommands: a bad flag value is argparse's usage error
(exit status 2) naming the flag and the value; a bad list file or TARGET is one
line, ``python -m hmp CMD: error: ...``, naming the absolute path or the close
names, exit status 2, before anything runs; never a traceback."""

import re
from pathlib import Path

import pytest
import torch

import hmp
from hmp.__main__ import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--steps", "0"], "--steps: expected a positive integer, got 0"),
        (["demo", "--steps", "ten"], "--steps: expected a positive integer, got 'ten'"),
        (["demo", "--batch-size", "-3"], "--batch-size: expected a positive integer, got -3"),
        (["demo", "--opt-level", "O3"], "--opt-level: invalid choice"),
        (["demo", "--device", "tpu"], "--device: invalid choice"),
        (["demo", "--seed", "-1"], "--seed: expected an integer from 0"),
        (["demo", "--long", "--steps", "5"], "argument --steps: not allowed with argument --long"),
        (["tune", "--steps", "0"], "--steps: expected a positive integer, got 0"),
        (["tune", "--rounds", "two"], "--rounds: expected a positive integer, got 'two'"),
        (["tune", "--seed", "-1"], "--seed: expected an integer from 0"),
        (["tune", "--tolerance", "2"], "--tolerance: expected a fraction between 0 and 1"),
        (["tune", "--tolerance", "2%"], "--tolerance: expected a number such as 0.02, got '2%'"),
    ],
)
def test_bad_flag_values_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


TARGET = Path(__file__).resolve().parents[2] / "examples" / "tune_my_model.py"
# every subcommand that takes list files, with what it needs besides them (nothing runs: the files
# are checked first)
WITH_LISTS = {
    "audit": [f"{TARGET}:make_step"],
    "profile": [f"{TARGET}:make_step"],
    "tune": [f"{TARGET}:make_step"],
    "demo": ["--dry-run"],
}


def _one_error_line(err, command):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"python -m hmp {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("command", sorted(WITH_LISTS))
@pytest.mark.parametrize("flag", ["--bf16-file", "--fp32-file"])
def test_a_missing_list_file_is_one_line_naming_its_absolute_path(command, flag, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([command, *WITH_LISTS[command], flag, "missing.txt"]) == 2
    line = _one_error_line(capsys.readouterr().err, command)
    assert f"{flag} missing.txt: " in line and str(tmp_path / "missing.txt") in line and "No such file" in line
    assert not hmp.is_converted() and not list(tmp_path.iterdir())  # nothing ran, nothing written


@pytest.mark.parametrize("command", sorted(WITH_LISTS))
def test_a_missing_list_file_from_the_environment_is_one_line_too(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FP32_LIST", "gone.txt")
    assert main([command, *WITH_LISTS[command]]) == 2
    line = _one_error_line(capsys.readouterr().err, command)
    assert "$FP32_LIST" in line and str(tmp_path / "gone.txt") in line


@pytest.mark.parametrize("command", ["audit", "profile", "tune"])
def test_a_target_that_is_not_there_names_the_absolute_path_or_the_close_names(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([command, "nofile.py:make_step"]) == 2
    assert f"no file {str(tmp_path / 'nofile.py')!r}" in _one_error_line(capsys.readouterr().err, command)
    assert main([command, f"{TARGET}:make_stpe"]) == 2
    line = _one_error_line(capsys.readouterr().err, command)
    assert "has no function 'make_stpe'; did you mean" in line and f"{TARGET}:make_step" in line


def test_o2_names_the_list_files_it_ignores(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("include default\n")
    with pytest.warns(UserWarning, match=r"ignoring the given BF16 list file 'mine\.txt'"):
        hmp.convert(opt_level="O2", bf16_file_path="mine.txt")
    hmp.revert()
    assert main(["demo", "--opt-level", "O2", "--fp32-file", "mine.txt", "--dry-run"]) == 0
    assert "ignoring --fp32-file mine.txt" in capsys.readouterr().err


@pytest.mark.parametrize(
    "given, model, meant",
    [
        ("LayerNorn", None, "'torch.nn.LayerNorm'"),
        ("torch.nn.LayerNorn", None, "'torch.nn.LayerNorm'"),
        ("LayerNorn", torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)), "'torch.nn.LayerNorm'"),
        ("O.norm", torch.nn.ModuleDict({"0": torch.nn.ModuleDict({"norm": torch.nn.LayerNorm(2)})}), "'0.norm'"),
    ],
)
@pytest.mark.parametrize("argument", ["fp32_modules", "bf16_modules"])
def test_a_module_entry_that_matches_nothing_says_what_was_meant(given, model, meant, argument):
    with pytest.raises(ValueError, match=rf"hmp: {argument}\[0\]: .*did you mean {re.escape(meant)}\?") as e:
        hmp.convert(**{argument: [given]}, model=model)
    assert not hmp.is_converted() and given in str(e.value)


def test_help_names_the_command_as_it_was_run():
    """`hmp --help` (the installed script) says `hmp`; `python -m hmp --help` says `python -m hmp`."""
    import subprocess
    import sys
    from pathlib import Path

    from hmp.__main__ import invoked_as

    assert invoked_as("/venv/bin/hmp") == "hmp" and invoked_as("/x/hmp/__main__.py") == "python -m hmp"
    module = subprocess.run([sys.executable, "-m", "hmp", "--help"], capture_output=True, text=True, timeout=120)
    assert module.returncode == 0 and module.stdout.startswith("usage: python -m hmp ")
    script = Path(sys.executable).with_name("hmp")
    if not script.exists():
        pytest.skip("hmp is not installed as a script beside this Python")
    run = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("usage: hmp "), run.stdout[:200]
    demo = subprocess.run([str(script), "demo", "--help"], capture_output=True, text=True, timeout=120)
    assert demo.stdout.startswith("usage: hmp demo ") and "a few steps of each in" in demo.stdout


def test_profile_says_which_lists_it_ran_under(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("include default\ncumsum\n")
    assert main(["profile", f"{TARGET}:make_step", "--fp32-file", "mine.txt"]) == 0
    out = capsys.readouterr().out
    default = hmp.list_path("bf16")
    assert f"ran under the BF16 list hmp's default, {default} and the FP32 list mine.txt" in out
    assert "under opt_level O1: the bf16 list (" in out and "the fp32 list (" in out
