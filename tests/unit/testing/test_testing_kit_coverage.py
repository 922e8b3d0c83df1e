"""The testing kit does not mislead: asking for a strategy leaves the program's random streams
alone and answers the same on every seed; every op of every shipped list has sample calls under
every spelling; the documented recipe fails when an entry is never exercised; ``python -m hmp
check`` fails on an entry it skipped, flags an op autocast keeps in float32 moved to the lower
list, and calls a missing device bad input; the pytest plugin fails a test that leaves hmp
converted; the strategies without hypothesis say what to install."""

import importlib.metadata
import random
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import run_python
from hypothesis import HealthCheck, given, settings

import hmp
from hmp.__main__ import main
from hmp.testing import check_lists
from hmp.testing import strategies as hst
from hmp.testing.samples import BUILDERS

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[3]
LISTS = ROOT / "op_lists"
FP32 = torch.float32
DRAWS = settings(
    max_examples=3, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
)


def _streams(seed):
    """Seed torch's, Python's and numpy's global random streams; a function reading one value of each."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        numpy = None
    if numpy is not None:
        numpy.random.seed(seed)
    return lambda: (torch.rand(3).tolist(), random.random(), numpy.random.rand() if numpy is not None else None)


# ops without a shipped builder (probed) and one a probe cannot call (pixel_shuffle needs a factor);
# rand_like and bernoulli draw from torch's global stream when a probe calls them
PROBED = [torch.erfinv, torch.logdet, torch.linalg.eigh, torch.cholesky_solve, torch.linalg.solve, torch.rand_like]
PROBED += [torch.bernoulli, F.pixel_shuffle, "linalg_cond"]


@pytest.mark.parametrize("op", PROBED, ids=lambda op: getattr(op, "__name__", op))
def test_calls_leaves_the_random_streams_alone_and_answers_the_same_for_every_seed(op):
    answers = set()
    for seed in range(6):
        hst._FOUND.clear()  # probe afresh: the answer must not come from an earlier seed's
        want = _streams(seed)()
        read = _streams(seed)
        try:
            hst.calls(op)
            answers.add("strategy")
        except LookupError:
            answers.add("LookupError")
        assert read() == want, f"{op}: asking for a strategy moved a global random stream"
    assert len(answers) == 1, f"{op}: {answers} over six seeds"
    assert answers == ({"LookupError"} if op is F.pixel_shuffle else {"strategy"})


def _draws_calls_torch_runs(op, spelling=None):
    """Drawn float32 calls of ``spelling`` (default ``op``) run when ``op`` is called with them."""

    @DRAWS
    @given(hst.calls(op if spelling is None else spelling, dtypes=(FP32,)))
    def runs(call):
        args, kwargs = call
        op(*args, **kwargs)

    runs()


def test_a_probed_linear_algebra_op_draws_calls_torch_runs():
    for op in (torch.linalg.eigh, torch.cholesky_solve, torch.logdet):
        _draws_calls_torch_runs(op)


SPELLINGS = {
    "softmax": [torch.softmax, torch.Tensor.softmax, F.softmax, "softmax"],
    "log_softmax": [torch.log_softmax, torch.Tensor.log_softmax, F.log_softmax, torch.special.log_softmax],
    "cumsum": [torch.cumsum, torch.Tensor.cumsum, "cumsum"],
    "max_pool2d": ["max_pool2d", F.max_pool2d, torch.max_pool2d],
    "linalg_cholesky": [torch.linalg.cholesky, torch.cholesky, torch.Tensor.cholesky, "cholesky"],
    "add": [torch.add, torch.Tensor.add, torch.Tensor.add_, torch.Tensor.__add__, "add"],
}


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_every_spelling_of_an_op_resolves_to_its_builder(name):
    for spelling in SPELLINGS[name]:
        if hst.removed(spelling):  # torch 2.15 removed torch.cholesky: the name stays and raises
            continue
        assert hst.builder(spelling) is BUILDERS[name], spelling
        _draws_calls_torch_runs(hst.op_for(spelling) if isinstance(spelling, str) else spelling, spelling)


def _shipped_names():
    """Every op name of every shipped list file hmp converts with, and of the files of what
    torch.autocast computes in float32 (the FP32 list may take them in): module patterns, ``-``
    lines and includes left out."""
    files = ["bf16", "fp32", "promote", "bf16_strict", "fp16", "autocast_cpu_fp32", "autocast_cuda_fp32"]
    files += sorted(p.stem for p in LISTS.glob("o2_*.txt"))
    names = set()
    for stem in files:
        for line in (LISTS / f"{stem}.txt").read_text().splitlines():
            text = line.split("#")[0].strip()
            if text and not text.startswith(("-", "include ")) and "." not in text and "*" not in text:
                names.add(text)
    return sorted(names)


HOMES = (torch, F, torch.Tensor, torch.linalg, torch.special, torch.fft)


@pytest.mark.parametrize("name", _shipped_names())
def test_every_op_of_every_shipped_list_draws_calls_torch_runs_under_every_spelling(name):
    op = hst.op_for(name)
    if op is None or hst.removed(op):
        pytest.skip(f"no Python callable reaches {name} in torch {torch.__version__}")
    _draws_calls_torch_runs(op, name)
    for home in HOMES:
        spelling = getattr(home, name, None)
        if callable(spelling) and not isinstance(spelling, type):
            assert hst.builder(spelling) is not None, f"{getattr(home, '__name__', home)}.{name}"


def _plugin_installed():
    return any(
        ep.group == "pytest11" and ep.value == "_hmp_pytest"
        for dist in importlib.metadata.distributions()
        for ep in dist.entry_points
    )


needs_plugin = pytest.mark.skipif(not _plugin_installed(), reason="hmp is not installed with its entry points here")


def _recipe():
    """The test file docs/testing.md gives to copy (its first Python block)."""
    text = (ROOT / "docs" / "testing.md").read_text()
    section = text[text.index("## A test file to copy") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@needs_plugin
def test_the_documented_recipe_fails_when_an_entry_has_no_sample_calls(tmp_path):
    recipe = _recipe()
    assert '"my_bf16.txt"' in recipe
    (tmp_path / "my_bf16.txt").write_text("include default\nsoftmax\n")
    (tmp_path / "bad_bf16.txt").write_text("include default\nsoftmax\npixel_shuffle\n")
    (tmp_path / "test_good.py").write_text(recipe)
    (tmp_path / "test_bad.py").write_text(recipe.replace('"my_bf16.txt"', '"bad_bf16.txt"'))
    done = run_python("-m", "pytest", "-rA", "-p", "no:cacheprovider", cwd=tmp_path, timeout=300)
    outcome = {name: status for status, name in re.findall(r"^(PASSED|FAILED) (test_\w+\.py::\w+)", done.stdout, re.M)}
    good = {n: s for n, s in outcome.items() if n.startswith("test_good")}
    bad = {n: s for n, s in outcome.items() if n.startswith("test_bad")}
    assert good and set(good.values()) == {"PASSED"}, done.stdout[-3000:]
    assert bad["test_bad.py::test_every_listed_op_follows_the_rules"] == "FAILED", done.stdout[-3000:]
    assert bad["test_bad.py::test_every_listed_op_is_exercised"] == "FAILED", done.stdout[-3000:]
    assert "pixel_shuffle (no sample calls" in done.stdout


def test_check_fails_on_a_skipped_entry_and_flags_a_float32_op_moved_to_bf16(tmp_path, capsys):
    bf16 = tmp_path / "my_bf16.txt"
    bf16.write_text("include default\nmse_loss\npixel_shuffle\n")
    report = check_lists(bf16, examples=2, only={"mm", "mse_loss", "pixel_shuffle"})
    says = {v.name: v for v in report.verdicts}
    assert says["mm"].status == "ok"
    assert says["mse_loss"].status == "flagged" and says["mse_loss"].ok
    assert "torch.autocast computes it in float32" in says["mse_loss"].says
    assert "a loss moved to bfloat16" in says["mse_loss"].says
    assert says["pixel_shuffle"].status == "skipped" and not says["pixel_shuffle"].ok and not report.ok
    assert "no sample calls" in says["pixel_shuffle"].says and "build=" in says["pixel_shuffle"].says
    assert str(report).splitlines()[-1].startswith("not checked: pixel_shuffle")
    assert main(["check", str(bf16), "--only", "mse_loss", "pixel_shuffle", "--examples", "2"]) == 1
    out = capsys.readouterr().out
    assert "1 skipped, 1 flagged" in out
    assert not hmp.is_converted()


def test_check_on_a_device_this_machine_lacks_is_bad_input(capsys):
    missing = "cuda:99" if torch.cuda.is_available() else "cuda"
    assert main(["check", "--device", missing, "--examples", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m hmp check: error: device ")
    assert "not available on this machine" in lines[0]
    with pytest.raises(ValueError, match="not available"):
        check_lists(device=missing)


LEAKS = """
import pytest, hmp

KEPT = []

def test_leaves_a_block_open():
    KEPT.append(hmp.converted())  # kept: a block dropped is closed by the garbage collector
    KEPT[-1].__enter__()

def test_after_the_block():
    assert not hmp.is_converted()

def test_converts_without_revert():
    hmp.convert(opt_level="O2")

def test_after_the_convert():
    assert not hmp.is_converted()

def test_leaves_casts_off():
    hmp.disable_casts().__enter__()

def test_after_casts_off():
    assert hmp.casts_enabled()

def test_closes_its_block():
    with hmp.converted():
        assert hmp.is_converted()

@pytest.fixture
def reverting():
    yield
    hmp.revert()

def test_a_fixture_reverts_it(reverting):
    hmp.convert()

@pytest.fixture(scope="module")
def module_wide():
    with hmp.converted():
        yield

def test_under_a_module_fixture(module_wide):
    assert hmp.is_converted()
"""


@needs_plugin
def test_the_plugin_fails_a_test_that_leaves_hmp_converted_without_the_marker(pytester):
    pytester.makepyfile(test_leaks=LEAKS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(passed=9, errors=3)
    text = result.stdout.str()
    for name in ("test_leaves_a_block_open", "test_converts_without_revert", "test_leaves_casts_off"):
        assert f"ERROR at teardown of {name}" in text
    assert "hmp: the test left hmp converted (a converted() block entered and never exited" in text
    assert "hmp: the test left hmp's casts off" in text


WITHOUT_HYPOTHESIS = """
import sys
sys.modules["hypothesis"] = None  # as when it is not installed
import hmp.testing.strategies
"""


def test_the_strategies_without_hypothesis_say_what_to_install(tmp_path):
    done = run_python("-c", WITHOUT_HYPOTHESIS, cwd=tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: hmp.testing.strategies needs hypothesis"), last
    assert issubclass(ModuleNotFoundError, ImportError)
    assert "pip install hypothesis" in last and 'pip install ".[testing]"' in last
    extras = importlib.metadata.metadata("torch-hmp").get_all("Provides-Extra")
    assert "testing" in extras
