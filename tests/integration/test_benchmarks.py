"""Smoke test of the benchmark harness on the checkout's hmp: a quick run
passes the harness's own checks of its results (benchmarks/run.py,
check_results), benchmarks this checkout's hmp, and measures each
configuration's memory in a process of its own. It checks no speed."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from helpers import benchmark, run_python

from hmp.core import torch_releases

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
    # the timed calls are the ones the table names: bare torch is fp32, every scheme (the floor too) casts where
    # it should
    modes = {"bare", "autocast", "floor", "hmp"}
    for case in ("linear (training)", "linear (frozen_weights)", "linear (no_grad)", "mm", "Tensor.mm (a.mm(b))"):
        assert res[case]["dtype"] == {m: "float32" if m == "bare" else "bfloat16" for m in modes}, case
    for case in ("softmax (fp32, no cast)", "cat (one dtype, no cast)"):
        assert res[case]["dtype"] == dict.fromkeys(modes, "float32"), case
    assert all(set(r["added_us"]) == modes - {"bare"} and "hmp_over_floor_us" in r for r in res.values())
    assert "| mm |" in p.stdout and "hmp - floor" in p.stdout


def test_percall_prints_one_progress_line_not_one_per_rep(tmp_path):
    p = run_python(str(BENCHMARKS / "percall.py"), "--reps", "3", "--calls", "5", cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rep 1/3" not in p.stdout and "rep 2/3" not in p.stdout
    progress = [line for line in p.stderr.splitlines() if "rep" in line]
    # the count up front, then a line only where 10 s have passed (a busy machine takes that per rep:
    # the clock decides how many, so the test bounds it by the reps, never by time); each names its rep once
    assert progress[0] == "percall.py: timing: 3 reps" and len(progress) <= 3, progress
    assert all(line.count("rep ") == 1 for line in progress[1:]), progress


def _load_run():
    return benchmark("run.py")


def test_run_states_each_configurations_output_dtype_off_the_fast_path(tmp_path):
    # off the fused TransformerEncoder path (autocast's lot on CUDA) the encoder ends in norm2's
    # layer_norm of a float32 residual: float32 under autocast and hmp O1 alike (a norm is left to
    # torch: the consumer decides, no output rounded)
    out = tmp_path / "infer.json"
    args = ["--quick", "-w", "infer_b1", "-c", "fp32,autocast,hmp-O1,hmp-O1-ac,bf16", "--no-memory"]
    p = run_python(str(RUN), *args, "--no-fastpath", "--json", str(out), cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    w = res["workloads"]["infer_b1"]
    want = {"fp32": "float32", "autocast": "float32", "hmp-O1": "float32", "hmp-O1-ac": "float32", "bf16": "bfloat16"}
    assert w["out_dtype"] == w["expected_dtype"] == want
    # the check is not weakened: hmp O1 rounding the norm's output would be reported
    run = _load_run()
    configs = run.select(run.all_configs("cpu"), list(want))
    assert run.check_results(res, configs) == []
    w["out_dtype"]["hmp-O1"] = "bfloat16"
    assert run.check_results(res, configs) == ["infer_b1/hmp-O1: output dtype bfloat16, expected float32"]


def test_run_on_the_fast_path_every_mixed_configuration_ends_in_bf16(tmp_path):
    want = {"fp32": "float32", "autocast": "bfloat16", "hmp-O1": "bfloat16", "hmp-O1-ac": "bfloat16"}
    if torch.torch_version.TorchVersion(torch.__version__) < "2.5":
        del want["autocast"]  # torch 2.4's fused encoder raises under CPU autocast (bf16 meets fp32 weights)
    out = tmp_path / "infer.json"
    args = ["--quick", "-w", "infer_b1", "-c", ",".join(want), "--no-memory"]
    p = run_python(str(RUN), *args, "--json", str(out), cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    w = json.loads(out.read_text())["workloads"]["infer_b1"]
    assert w["out_dtype"] == w["expected_dtype"] == want


def test_decode_quick_converts_hmp_only_for_its_own_configurations(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "decode.json"
    p = run_python(str(BENCHMARKS / "decode.py"), "--quick", "--json", str(out), cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    names = ["fp32", "autocast", "floor", "hmp-O1", "hmp-O1-frozen", "bf16"]
    assert list(res["ms_per_token"]) == names
    cfgs = res["configs"]
    # hmp reverted outside its own samples: the other configurations (the floor's wrappers too) enter no wrapper
    for name in ("fp32", "autocast", "floor", "bf16"):
        assert cfgs[name]["wrapped_per_token"] == 0, name
    for name in ("hmp-O1", "hmp-O1-frozen"):
        assert cfgs[name]["wrapped_by_op_per_token"]["linear"] >= 1, cfgs[name]
        assert set(res["per_wrapped_call"][name]) == {"autocast", "floor", "bf16"}
    assert {n: c["logits_dtype"] for n, c in cfgs.items()} == {
        n: "float32" if n == "fp32" else "bfloat16" for n in names
    }
    assert all(len(c["tokens"]) == res["tokens"] for c in cfgs.values())
    assert [t["ratio"] for t in res["targets"]] == [
        "hmp-O1 / autocast",
        "hmp-O1-frozen / autocast",
        "hmp-O1-frozen / hmp-O1",
    ]
    assert sum(line.startswith("- target ") for line in p.stdout.splitlines()) == 3


@pytest.mark.slow  # about 15 s: a tiny Llama built twice, two rounds on two devices
def test_hostcost_quick_reports_every_configuration_on_both_devices(tmp_path):
    """benchmarks/hostcost.py --quick on fastmeta and cpu: every case and configuration reported with a
    finite time (autocast's decode token on meta, which it does not emulate, excepted), each
    configuration computing in its own dtype. It checks no speed."""
    pytest.importorskip("transformers")
    out = tmp_path / "hostcost.json"
    args = ["--quick", "--devices", "fastmeta,cpu", "--json", str(out)]
    p = run_python(str(BENCHMARKS / "hostcost.py"), *args, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    configs = ["torch", "autocast", "floor", "hmp", "hmp frozen"]
    cases = ["linear (grad)", "linear (no_grad)", "mm (no_grad)", "matmul (no_grad)", "softmax (no_grad, FP32 list)"]
    assert list(res["results"]) == ["fastmeta", "cpu"]
    assert res["meta"]["fastmeta"]["cpp"] > 0  # torch's C++ meta kernels were put back
    for device, rows in res["results"].items():
        assert list(rows) == [*cases, "decode token"], device
        for case, row in rows.items():
            timed = [c for c in configs if not (c == "hmp frozen" and case == "linear (grad)")]
            if device == "fastmeta" and case == "decode token":
                timed.remove("autocast")
            assert all(math.isfinite(row["us"][c]) and row["us"][c] > 0 for c in timed), (device, case, row["us"])
            assert all(math.isfinite(row["added_us"][c]) for c in timed if c != "torch"), (device, case)
            assert row["hmp_over_floor"] is None or math.isfinite(row["hmp_over_floor"])
            assert set(row["dtype"]) == set(timed), (device, case, row["dtype"])
            cast = case != "softmax (no_grad, FP32 list)"
            want = {c: "bfloat16" if cast and c != "torch" else "float32" for c in timed}
            assert row["dtype"] == want, (device, case)
    assert {(t["device"], t["case"], t["ratio"]) for t in res["targets"]} >= {
        ("fastmeta", "linear (grad)", "hmp / floor"),
        ("fastmeta", "linear (no_grad)", "hmp / floor"),
        ("fastmeta", "decode token", "hmp / floor"),
        ("fastmeta", "decode token", "hmp frozen / hmp"),
    }
    assert "| linear (grad) |" in p.stdout and "| decode token |" in p.stdout
    # per decode token over plain torch, counted: Python frames, C calls and bytecode instructions (opcodes)
    for device, per_token in res["calls_per_token_over_torch"].items():
        assert set(per_token) == {"floor", "hmp", "hmp frozen"}, device
        for config, (frames, c_calls, opcodes) in per_token.items():
            assert frames > 0 and c_calls > 0 and opcodes > frames, (device, config, per_token[config])


@pytest.mark.slow  # two compiles of a one-layer Llama's decode
@pytest.mark.torch_internals  # compiled code follows hmp on every release CI tests (issue 54)
def test_compiled_decode_runs_and_follows_hmp(tmp_path):
    """benchmarks/decode.py --compiled on the running torch: hmp O1 and fp32 compile, decode and give
    their own dtypes; hmp is converted for the phase and fp32 runs inside disable_casts(),
    which compiled code honours where dynamo can trace hmp's thread state (docs/torch-releases.md)."""
    pytest.importorskip("transformers")
    out = tmp_path / "decode.json"
    # hmp's phase and disable_casts() inside it, on one layer: autocast's and bf16's compiles are torch's own
    args = ["--quick", "--only-compiled", "--layers", "1", "--compiled-configs", "hmp-O1,fp32", "--json", str(out)]
    p = run_python(str(BENCHMARKS / "decode.py"), *args, cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    cfgs = json.loads(out.read_text())["compiled"]["configs"]
    dtypes = {n: c["logits_dtype"] for n, c in cfgs.items()}
    assert dtypes["hmp-O1"] == "bfloat16", dtypes
    if torch_releases.BOUNDARIES["traced_state_writes"].present:
        assert dtypes["fp32"] == "float32", dtypes


def _tables(markdown):
    """heading -> {first cell: the row's cells} of the tables under each '## ' heading."""
    out, heading = {}, None
    for line in markdown.splitlines():
        if line.startswith("## "):
            heading = line[3:]
            out[heading] = {}
        elif heading and line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out[heading].setdefault(cells[0], cells)
    return out


@pytest.mark.slow  # about 40 s: two GPT-2 builds, four compiles, a decode and the per-call table
def test_gpu_dry_run_reports_every_configuration_with_a_ratio(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "cuda.md"
    p = run_python(str(BENCHMARKS / "gpu.py"), "--dry-run", "--out", str(out), cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    tables = _tables(out.read_text())
    sections = {
        key: next(h for h in tables if h.startswith(key))
        for key in ("Training step, eager", "Training step, torch.compile", "Decode", "Per call")
    }
    for key in ("Training step, eager", "Training step, torch.compile"):
        rows = tables[sections[key]]
        for name in ("fp32", "autocast", "hmp-O1", "bf16"):
            vs_autocast = float(rows[name][2])
            assert vs_autocast > 0, (key, rows[name])
        assert float(rows["autocast"][2]) == 1.0
        # each configuration computed in its own precision, compiled too
        assert rows["fp32"][6] == "float32" and rows["bf16"][6] == "bfloat16", rows
        assert rows["hmp-O1"][6] == rows["autocast"][6] == "bfloat16", rows
        # a timed step that compiles would time the compiler (hmp converts afresh every round)
        assert all(rows[n][7] == "0" for n in ("fp32", "autocast", "hmp-O1", "bf16")), rows
    rows = tables[sections["Decode"]]
    for name in ("fp32", "autocast", "hmp-O1", "hmp-O1-frozen", "bf16"):
        assert float(rows[name][2]) > 0, rows[name]
    assert rows["hmp-O1"][4] != "0" and rows["autocast"][4] == "0"  # wrapped calls per token
    rows = tables[sections["Per call"]]
    for case in ("linear (training)", "linear (frozen_weights)", "linear (no_grad)", "mm", "Tensor.mm (a.mm(b))"):
        # bare, autocast, floor, hmp, hmp - floor, target, met, GPU kernels per call (bare / autocast / floor / hmp)
        assert case in rows and len(rows[case]) == 9
        bare, autocast, floor, mine = (int(n) for n in rows[case][8].split(" / "))
        # one launch per cast, as autocast's; fewer where the same unchanged activation's copy is shared
        assert bare == 1 and mine <= autocast == floor, rows[case]
    assert "DRY RUN" in out.read_text()
