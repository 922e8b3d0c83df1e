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

import hmp
from hmp.__main__ import main
from hmp.demo import LONG_STEPS, STEPS, add_parser, data
from hmp.demo.sizing import MIN_STEPS as MIN_STEPS_DEFAULT
from hmp.demo.training import Config, count_casts, train

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def small_corpus():
    return data.load(train_chars=200_000, val_chars=40_000)


def run_cli(*args, timeout=600):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "hmp", "demo", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


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
    # the longest sized run on the smaller model the demo falls back to: a quarter of the default model's
    # work (about 9 s for both on a quiet 2-core CPU with native bf16), so a busy machine stays far
    # inside the test timeout
    cfg = Config(steps=STEPS, batch_size=4, n_layers=2)
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


def test_long_is_a_longer_run():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert parser.parse_args(["demo"]).steps is None  # sized to the machine (hmp.demo.sizing)
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


@pytest.mark.parametrize("tqdm_installed", [True, False])
def test_demo_progress_without_a_terminal_prints_lines_with_time_left(tqdm_installed):
    # stderr is a pipe here, as in CI or `2> log`: lines every LINE_EVERY_S seconds, no bar, with or without tqdm
    code = (
        "import sys\n" + ("" if tqdm_installed else "sys.modules['tqdm'] = None\n") + "import hmp.demo as demo\n"
        "demo.LINE_EVERY_S = 0.0\n"
        "p = demo._Progress('hmp O1', 4)\n"
        "for step in range(4):\n"
        "    p(step, 2.5)\n"
        "p.close({'wall_s': 1.25, 'val_loss': 2.0})\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert lines[0].endswith("training hmp O1: 4 steps")
    assert [line.split(": step ")[1].split(",")[0] for line in lines[1:-1]] == ["1/4", "2/4", "3/4"]
    assert all("loss 2.500, about" in line and line.endswith(" s left") for line in lines[1:-1])
    assert lines[-1].endswith("trained hmp O1 in 1.2 s, val loss 2.0000")
    assert "\r" not in res.stderr  # no bar redrawn into a log


# ---- sizing to the machine ----------------------------------------------------

X86 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f {extra}\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd {extra}\n"


@pytest.mark.parametrize(
    "machine, text, expected",
    [
        ("x86_64", X86.format(extra="avx512_bf16"), True),
        ("x86_64", X86.format(extra="amx_bf16 amx_tile"), True),
        ("x86_64", X86.format(extra="avx512_vnni"), False),  # AVX-512 without its bf16 instructions
        ("aarch64", ARM.format(extra="bf16 i8mm"), True),
        ("aarch64", ARM.format(extra="sve"), False),
        ("riscv64", "isa\t: rv64imafdc\n", None),
    ],
)
def test_native_bf16_reads_the_cpus_flags(machine, text, expected):
    from hmp.demo.sizing import native_bf16

    has, why = native_bf16("cpu", cpuinfo=text, machine=machine)
    assert has is expected and why


@pytest.mark.parametrize(
    "ratio, words", [(0.4, "faster than fp32"), (1.0, "about fp32's speed"), (2.07, "SLOWER than fp32")]
)
def test_expectation_says_what_the_measured_ratio_means(ratio, words):
    from hmp.demo.sizing import expectation

    line = expectation(ratio, (False, "no avx512_bf16"))
    assert words in line and f"{ratio:.2f}x" in line and "no avx512_bf16" in line


def test_fit_picks_the_largest_model_that_fits_and_times_few_models():
    from hypothesis import given
    from hypothesis import strategies as st

    from hmp.demo.sizing import LADDER, MIN_STEPS, fit

    cfg = Config()
    assert {k: getattr(cfg, k) for k in LADDER[0]} == LADDER[0]  # the default model heads the ladder

    def work(c):  # written apart from sizing.flops: tokens x layers x width^2
        return c.batch_size * c.seq_len * c.n_layers * c.d_model * c.d_model

    # a machine: a fixed cost per step plus a cost per unit of work, both drawn
    @given(
        fixed=st.floats(1e-4, 5.0),
        per_work=st.floats(1e-12, 1e-6),
        budget=st.floats(1.0, 600.0),
        max_steps=st.integers(MIN_STEPS, 1000),
    )
    def check(fixed, per_work, budget, max_steps):
        timed = []

        def measure(c):
            timed.append(c)
            return fixed + per_work * work(c)

        p = fit(cfg, measure, budget, max_steps)
        c = p.cfg
        fields = {k: getattr(c, k) for k in LADDER[0]}
        per = fixed + per_work * work(c)
        assert fields in LADDER and p.shrunk == (fields != LADDER[0]) and p.measured == len(timed)
        assert MIN_STEPS <= c.steps <= max_steps
        assert p.seconds == pytest.approx(c.steps * per)
        fits = [f for f in LADDER if (fixed + per_work * work(Config(**f))) * MIN_STEPS <= budget]
        if fits:
            # the largest that fits, or a smaller one only when the walk up was cut short by its guess
            assert per * MIN_STEPS <= budget and c.steps * per <= budget * (1 + 1e-9)
            assert LADDER.index(fields) >= LADDER.index(fits[0])
        else:
            assert fields == LADDER[-1] and c.steps == MIN_STEPS and len(timed) == 1  # nothing fits: the smallest
        # timed from the smallest up to the chosen one, and at most one past it
        assert timed[0] == Config(**LADDER[-1]) and len(timed) <= len(LADDER) - LADDER.index(fields) + 1

    check()


@pytest.mark.parametrize("per_work", [1e-10, 1e-9, 1e-8, 1e-7])
def test_fit_with_step_time_proportional_to_work_chooses_exactly_the_largest_that_fits(per_work):
    from hmp.demo.sizing import LADDER, MIN_STEPS, fit

    def work(c):
        return c.batch_size * c.seq_len * c.n_layers * c.d_model * c.d_model

    p = fit(Config(), lambda c: per_work * work(c), 40.0, 120)
    fits = [f for f in LADDER if per_work * work(Config(**f)) * MIN_STEPS <= 40.0]
    expected = fits[0] if fits else LADDER[-1]
    assert {k: getattr(p.cfg, k) for k in LADDER[0]} == expected


@pytest.mark.slow  # about a minute: the whole default run
def test_default_run_says_what_to_expect_and_sizes_itself_first(tmp_path):
    out = tmp_path / "demo.json"
    proc = run_cli("--device", "cpu", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert "a bf16 matmul takes" in lines[0] and "expect" in lines[0]
    assert "sized to this machine:" in lines[1]
    res = json.loads(out.read_text())
    meta = res["meta"]
    assert MIN_STEPS_DEFAULT <= meta["steps"] <= STEPS
    assert f"{meta['steps']} steps per configuration" in lines[1]
    assert meta["native_bf16"] in (True, False, None) and meta["native_bf16_why"]
