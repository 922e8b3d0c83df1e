"""``python -m hmp demo`` and its pieces: data, cast counting, numerical
quality of hmp against fp32 on the demo model, and the command line."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hmp
from hmp.__main__ import main
from hmp.demo import LONG_STEPS, STEPS, add_parser, data
from hmp.demo.training import Config, count_casts, train

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def small_corpus():
    return data.load(train_chars=200_000, val_chars=40_000)


def run_cli(*args, timeout=600):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "hmp", "demo", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


# ---- data ------------------------------------------------------------------

def test_data_is_stdlib_source_and_deterministic():
    a = data.load(train_chars=50_000, val_chars=10_000)
    b = data.load(train_chars=50_000, val_chars=10_000)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.train_files == b.train_files and a.val_files == b.val_files
    assert a.root == data.stdlib_dir()
    names = [p.name for p in data.stdlib_files()]
    assert names == sorted(names)
    assert set(a.train_files) <= set(names) and set(a.val_files) <= set(names)
    assert not set(a.train_files) & set(a.val_files)
    assert 50_000 <= a.train.numel() <= 50_001 and 10_000 <= a.val.numel() <= 10_001
    assert a.train.dtype == torch.int64 and int(a.train.max()) < data.VOCAB
    # the training text starts with the first public stdlib module, verbatim
    first = (data.stdlib_dir() / a.train_files[0]).read_text(encoding="utf-8")
    assert data.decode(a.train[:2000]) == first[:2000].encode("ascii", "replace").decode()
    assert "def " in data.decode(a.train) and "import " in data.decode(a.val)


def test_unigram_baseline_is_an_entropy():
    c = data.load(train_chars=50_000, val_chars=10_000)
    assert 2.0 < c.unigram_baseline() < torch.log(torch.tensor(float(data.VOCAB))).item()


def test_missing_stdlib_sources_is_a_clear_error(tmp_path):
    with pytest.raises(data.DataError, match="no standard library source"):
        data.stdlib_files(tmp_path)


# ---- cast counting -----------------------------------------------------------

def test_count_casts_on_the_demo_model(small_corpus):
    cfg = Config(batch_size=2, n_layers=2)
    per_op, total, calls = count_casts(cfg, small_corpus, {"opt_level": "O1"})
    n_linear = 4 * cfg.n_layers + 1  # qkv, proj, two MLP layers per block, and the head
    assert per_op["linear"] == {"bfloat16": 2 * n_linear}  # each weight and bias, every step
    assert per_op["cross_entropy"] == {"float32": 1}  # the bf16 logits
    assert total == sum(sum(v.values()) for v in per_op.values()) and calls >= 3 * cfg.n_layers
    assert not hmp.is_converted()


# ---- numerical quality -------------------------------------------------------

@pytest.mark.slow
def test_hmp_validation_loss_within_2_percent_of_fp32():
    corpus = data.load()
    cfg = Config(steps=STEPS, batch_size=8)  # the demo's default run: about 40 s for both on a quiet 2-core CPU
    fp32 = train(cfg, corpus)
    mixed = train(cfg, corpus, {"opt_level": "O1"})
    assert not hmp.is_converted()
    baseline = corpus.unigram_baseline()
    # both learned well beyond what character frequencies alone give
    # (about 3.2 nats/char on the stdlib; these runs reach about 2.7)
    assert fp32["val_loss"] < baseline - 0.4 and mixed["val_loss"] < baseline - 0.4, (baseline, fp32, mixed)
    assert abs(mixed["val_loss"] / fp32["val_loss"] - 1) <= 0.02, (fp32["val_loss"], mixed["val_loss"])
    assert fp32["losses"] != mixed["losses"]  # hmp really changed the arithmetic


# ---- command line --------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps: expected a positive integer, got 0"),
    (["--steps", "ten"], "--steps: expected a positive integer, got 'ten'"),
    (["--batch-size", "-3"], "--batch-size: expected a positive integer, got -3"),
    (["--opt-level", "O3"], "--opt-level: invalid choice"),
    (["--device", "tpu"], "--device: invalid choice"),
    (["--seed", "-1"], "--seed: expected an integer from 0"),
    (["--long", "--steps", "5"], "argument --steps: not allowed with argument --long"),
])
def test_bad_flag_values_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_long_is_a_longer_run():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert parser.parse_args(["demo"]).steps == STEPS
    assert parser.parse_args(["demo", "--long"]).steps == LONG_STEPS > STEPS
    assert parser.parse_args(["demo", "--steps", "7"]).steps == 7


def test_bad_flag_from_the_command_line():
    proc = run_cli("--steps", "-1")
    assert proc.returncode == 2
    assert "--steps: expected a positive integer, got -1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_list_file_is_a_clear_error(tmp_path):
    missing = tmp_path / "no_such_list.txt"
    proc = run_cli("--bf16-file", str(missing), "--steps", "1")
    assert proc.returncode == 2, proc.stderr
    assert str(missing) in proc.stderr and "BF16 list file" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_bad_list_file_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "fp32.txt"
    bad.write_text("softmax\nno_such_op_anywhere\n")
    assert main(["demo", "--fp32-file", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "no_such_op_anywhere" in err
    assert not hmp.is_converted()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_cuda_is_a_clear_error():
    proc = run_cli("--device", "cuda")
    assert proc.returncode == 2
    assert "--device cuda: CUDA is not available" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_unavailable_hpu_is_a_clear_error(capsys):
    import importlib.util

    if importlib.util.find_spec("habana_frameworks") is not None:
        pytest.skip("habana_frameworks is installed")
    assert main(["demo", "--device", "hpu"]) == 2
    assert "--device hpu: habana_frameworks is not installed" in capsys.readouterr().err


def test_json_directory_must_exist(tmp_path, capsys):
    assert main(["demo", "--json", str(tmp_path / "nope" / "out.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow  # about 15 s: the whole command, its memory subprocesses included
def test_json_output_has_the_table_fields(tmp_path):
    out = tmp_path / "demo.json"
    proc = run_cli("--steps", "3", "--batch-size", "2", "--device", "cpu", "--seed", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    res = json.loads(out.read_text())
    meta = res["meta"]
    assert meta["steps"] == 3 and meta["batch_size"] == 2 and meta["seed"] == 1 and meta["device"] == "cpu"
    assert meta["unigram_baseline"] > 0 and meta["params"] > 0 and meta["bf16_matmul_time_vs_fp32"] > 0
    fp32, mixed = res["results"]
    assert fp32["configuration"] == "fp32" and mixed["configuration"] == "hmp O1 (bfloat16)"
    for r in (fp32, mixed):
        for key in ("tokens_per_s", "time_vs_fp32", "peak_memory_mib", "train_loss", "val_loss", "wall_s"):
            assert isinstance(r[key], float) and r[key] > 0, (key, r)
        assert len(r["losses"]) == 3
    assert fp32["time_vs_fp32"] == 1.0
    assert mixed["time_vs_fp32"] == pytest.approx(fp32["tokens_per_s"] / mixed["tokens_per_s"])
    assert res["val_loss_change_pct"] == pytest.approx(100 * (mixed["val_loss"] / fp32["val_loss"] - 1))
    assert res["casts"]["per_op"]["linear"]["bfloat16"] > 0 and res["casts"]["total_per_step"] > 0
    # the printed table carries the same numbers
    for r in (fp32, mixed):
        assert f"{r['val_loss']:.4f}" in proc.stdout and r["configuration"] in proc.stdout
    assert "unigram baseline" in proc.stdout and "casts hmp made per training step" in proc.stdout


def test_demo_progress_without_tqdm_prints_start_and_end_lines():
    # tqdm is the `demo` extra; without it the demo reports with plain lines
    code = ("import sys; sys.modules['tqdm'] = None\n"
            "from hmp.demo import _Progress, tqdm\n"
            "assert tqdm is None\n"
            "p = _Progress('hmp O1', 3)\n"
            "p(1, 2.5)\n"
            "p.close({'wall_s': 1.25, 'val_loss': 2.0})\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "training hmp O1: 3 steps" in res.stderr
    assert "trained hmp O1 in 1.2 s, val loss 2.0000" in res.stderr
