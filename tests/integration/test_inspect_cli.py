"""``python -m hmp audit`` and ``python -m hmp profile`` on the shipped
example target (examples/tune_my_model.py, as tune's tests use): the tables
on stdout and the HTML page ``--report`` writes."""

import json
from pathlib import Path

import pytest

import hmp
from hmp.__main__ import main

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tune_my_model.py"


def test_audit_runs_the_example_and_writes_its_report(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["audit", f"{EXAMPLE}:make_step", "--report", "audit.html", "--json", "audit.json"]) == 0
    out = capsys.readouterr().out
    assert "| linear |" in out and "wrote audit.html" in out
    page = (tmp_path / "audit.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "hmp audit report" in page and ">linear<" in page
    ops = {row["op"] for row in json.loads((tmp_path / "audit.json").read_text())["ops"]}
    assert {"linear", "cross_entropy"} <= ops
    assert not hmp.is_converted()  # the configuration before the command is back


def test_profile_runs_the_example_and_writes_its_report(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["profile", f"{EXAMPLE}:make_step", "--report", "profile.html", "--json", "profile.json"]) == 0
    out = capsys.readouterr().out
    rows = {row["op"]: row for row in json.loads((tmp_path / "profile.json").read_text())["ops"]}
    assert rows["linear"]["calls"] == 3 and rows["linear"]["ran_in"].startswith("bfloat16")
    assert "| linear | 3 |" in out
    page = (tmp_path / "profile.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "hmp profile report" in page
    assert '<td>linear</td><td class="num">3</td>' in page
    assert not hmp.is_converted()


@pytest.mark.parametrize("command", ["audit", "profile"])
def test_a_bad_target_is_the_same_clear_error_as_tunes(tmp_path, monkeypatch, command, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([command, "nomodule:make_step", "--report", "r.html"]) == 2
    err = capsys.readouterr().err
    assert f"python -m hmp {command}: error: TARGET 'nomodule:make_step': no module 'nomodule'" in err
    assert "Traceback" not in err and not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("command", ["audit", "profile"])
def test_the_lists_to_run_under_can_be_given(tmp_path, monkeypatch, command, capsys):
    """--bf16-file: here a BF16 list without linear, so linear runs in float32."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bf16.txt").write_text("include default\n-linear\n")
    assert main([command, f"{EXAMPLE}:make_step", "--bf16-file", "bf16.txt", "--json", "out.json"]) == 0
    linear = [row for row in json.loads((tmp_path / "out.json").read_text())["ops"] if row["op"] == "linear"]
    if command == "audit":
        assert all(row["list"] != "bf16" for row in linear)
    else:
        assert all(row["ran_in"].startswith("float32") for row in linear)
    default = tmp_path / "default.json"
    assert main([command, f"{EXAMPLE}:make_step", "--json", str(default)]) == 0  # and without the file, it is cast
    linear = [row for row in json.loads(default.read_text())["ops"] if row["op"] == "linear"]
    assert linear and all(row.get("list", "bf16") == "bf16" for row in linear)
