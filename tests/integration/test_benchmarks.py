"""Smoke test of the benchmark harness on the checkout's hmp: a quick run
passes the harness's own checks of its results (benchmarks/run.py,
check_results), benchmarks this checkout's hmp, and measures each
configuration's memory in a process of its own. It checks no speed."""

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import run_python

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
RUN = BENCHMARKS / "run.py"
# the torch release op_lists/autocast_*.txt were generated from
AUTOCAST_LISTS_TORCH = re.search(
    r"for torch (\S+?)\.?$", (ROOT / "op_lists" / "autocast_cpu_bf16.txt").read_text(), re.M
).group(1)


@pytest.mark.slow  # about 20 s: the harness and its memory subprocesses
def test_quick_run_passes_its_own_checks(tmp_path):
    out = tmp_path / "mlp.json"
    p = run_python(str(RUN), "--quick", "--workload", "mlp", "--json", str(out), cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert Path(res["meta"]["hmp_path"]) == ROOT / "hmp"  # the checkout's hmp is the one benchmarked
    assert list(res["workloads"]) == ["mlp"] and "| mlp |" in p.stdout
    for row in res["memory"]["mlp"].values():
        # a 64-wide MLP needs next to nothing; a large value means the parent's peak leaked in
        assert row["delta_mb"] < 100, row


@pytest.mark.skipif(
    torch.__version__.split("+")[0] != AUTOCAST_LISTS_TORCH,
    reason=f"op_lists/autocast_*.txt transcribe torch {AUTOCAST_LISTS_TORCH}'s autocast lists; "
    f"other releases list other ops",
)
def test_autocast_lists_up_to_date():
    p = run_python(str(BENCHMARKS / "autocast_lists.py"), "--check", cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr


def test_percall_compares_the_schemes_on_what_each_returns(tmp_path):
    out = tmp_path / "percall.json"
    p = run_python(
        str(BENCHMARKS / "percall.py"), "--reps", "1", "--calls", "5", "--json", str(out), cwd=ROOT, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    # the timed calls are the ones the table names: bare torch is fp32, every scheme casts where it should
    modes = {"bare", "autocast", "hmp"}
    for case in ("linear (training)", "linear (inference)", "mm", "Tensor.mm (a.mm(b))"):
        assert res[case]["dtype"] == {m: "float32" if m == "bare" else "bfloat16" for m in modes}, case
    for case in ("softmax (fp32, no cast)", "cat (one dtype, no cast)"):
        assert res[case]["dtype"] == dict.fromkeys(modes, "float32"), case
    assert "| mm |" in p.stdout


def test_percall_prints_one_progress_line_not_one_per_rep(tmp_path):
    p = run_python(str(BENCHMARKS / "percall.py"), "--reps", "3", "--calls", "5", cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rep 1/3" not in p.stdout and "rep 2/3" not in p.stdout
    progress = [line for line in p.stderr.splitlines() if "rep" in line]
    # the count up front; a line every 10 s on a slow machine, never one per rep
    assert progress[0] == "percall.py: timing: 3 reps" and len(progress) < 3, progress
