"""Smoke test of the benchmark harness: it runs and its JSON has the
expected shape. It checks structure, never speed."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "benchmarks" / "run.py"
CONFIGS = ["fp32", "autocast", "hmp-O1", "hmp-O1-ac", "hmp-O2", "hmp-O1-frozen", "bf16"]


@pytest.fixture(scope="module")
def quick_mlp(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "mlp.json"
    p = subprocess.run([sys.executable, str(RUN), "--quick", "--workload", "mlp", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout


def test_meta(quick_mlp):
    res, _ = quick_mlp
    meta = res["meta"]
    assert meta["device"] == "cpu" and meta["quick"] is True
    assert meta["threads"] >= 1
    assert [c["name"] for c in meta["configs"]] == CONFIGS
    # the checkout's hmp is the one benchmarked
    assert Path(meta["hmp_path"]) == ROOT / "hmp"
    assert set(res["convert_cost"]) == {"hmp-O1", "hmp-O1-ac", "hmp-O2", "hmp-O1-frozen"}


def test_timings(quick_mlp):
    res, _ = quick_mlp
    assert list(res["workloads"]) == ["mlp"]
    w = res["workloads"]["mlp"]
    assert list(w["median_ms"]) == CONFIGS
    for name in CONFIGS:
        samples = w["samples_ms"][name]
        assert len(samples) == w["reps"] >= 1
        assert all(s > 0 and math.isfinite(s) for s in samples)
        assert min(samples) == w["min_ms"][name] <= w["median_ms"][name] <= max(samples)
    assert w["out_dtype"]["fp32"] == "float32"
    for name in CONFIGS[1:]:
        assert w["out_dtype"][name] == "bfloat16", name


def test_memory(quick_mlp):
    res, _ = quick_mlp
    per = res["memory"]["mlp"]
    assert set(per) == set(CONFIGS)
    for row in per.values():
        assert {"baseline_mb", "peak_mb", "delta_mb", "steps", "method"} <= set(row)
        assert math.isfinite(row["delta_mb"])
        # a 64-wide MLP needs next to nothing; a large value means the parent's peak leaked in
        assert row["delta_mb"] < 100, row


def test_targets_and_markdown(quick_mlp):
    res, stdout = quick_mlp
    rows = [r for r in res["targets"] if r["workload"] == "mlp" and r["metric"] == "HMP / autocast"]
    assert len(rows) == 1
    assert set(rows[0]["values"]) == {"hmp-O1", "hmp-O1-ac", "hmp-O2", "hmp-O1-frozen"}
    assert all(isinstance(v, bool) for v in rows[0]["pass"].values())
    assert "## Time per step" in stdout and "| mlp |" in stdout and "## Targets" in stdout


def test_autocast_lists_up_to_date():
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "autocast_lists.py"), "--check"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
