"""hmp.testing, the kit users test their cast rules with: its oracle agrees with what runs, its
checks fail where a rule is broken, its strategies draw valid calls of every shipped list's ops,
its pytest plugin converts for one test only, and ``python -m hmp check`` says what each entry
does."""

import importlib.metadata
import re
from pathlib import Path
from types import FunctionType

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import run_python
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

import hmp
from hmp.__main__ import main
from hmp.core import cast_copies
from hmp.core.identity import unwrap
from hmp.testing import (
    assert_follows_rules,
    assert_runs_as,
    check_lists,
    expected_call,
    expected_dtype,
    follow,
    record_ops,
)
from hmp.testing import strategies as hst
from hmp.testing.follows import first_floating
from hmp.testing.recording import SEES_BODIES
from hmp.testing.samples import BUILDERS

ROOT = Path(__file__).resolve().parents[3]
BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
SOFTMAX_IN_BF16 = "include default\nsoftmax\n"
CONFIGS = {
    "O1": {},
    "O2": {"opt_level": "O2"},
    "strict": {"strict": True},
    "softmax in BF16": {"bf16_file_path": SOFTMAX_IN_BF16},
}
DRAWS = settings(
    max_examples=4, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
)


def _convert(config, tmp_path, **more):
    kwargs = dict(CONFIGS[config], **more)
    if "bf16_file_path" in kwargs:
        path = tmp_path / "my_bf16.txt"
        path.write_text(kwargs["bf16_file_path"])
        kwargs["bf16_file_path"] = path
    hmp.convert(**kwargs)


def _removed(name):
    """torch removed the op and left a Python function that raises in its place (torch 2.15's
    torch.qr): no aten op of that name, and torch's function of it is written in Python."""
    fn = getattr(torch, name, None)
    return isinstance(fn, FunctionType) and fn.__module__.startswith("torch._") and not hasattr(torch.ops.aten, name)


def _listed_ops():
    listed = {n for names in hmp.effective_lists().values() for n in names if "." not in n and "*" not in n}
    return sorted(n for n in listed if not _removed(n))


def _copies(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copies(v) for v in value)
    return {k: _copies(v) for k, v in value.items()} if isinstance(value, dict) else value


def _outcome(fn):
    try:
        return fn(), None
    except Exception as e:
        return None, e


def _delegated(name):
    """engine="autocast": torch's dispatcher casts the entry, below where record_ops sees the call
    (docs/engines.md); the result's dtype is still checked."""
    return any("dispatcher" in str(v.get(name, "")) for v in hmp.effective_lists(detail=True).values())


def _cast_at(ran):
    """The call hmp's wrapper casts for: a Python function calling its listed builtin by name
    (F.kl_div's torch.kl_div) is left as torch's, and the builtin inside it receives the casts."""
    inner = [r for r in ran.inner if r.name == ran.name]
    return _cast_at(inner[0]) if inner else ran


def _agrees(op, args, kwargs):
    """expected_dtype against what runs: the call under hmp returns its floating result in that dtype
    (plain torch's dtype where the oracle leaves the call to torch), and torch received the tensors
    in the dtypes the oracle says (recorded where torch's function sees them)."""
    with hmp.disable_casts():
        plain, plain_error = _outcome(lambda: op(*_copies(args), **_copies(kwargs)))
    expected, oracle_error = _outcome(lambda: expected_call(op, *args, **kwargs))
    copied, copied_kwargs = _copies(args), _copies(kwargs)
    with torch.random.fork_rng(devices=[]), record_ops() as ran:
        recorded, _ = _outcome(lambda: op(*copied, **copied_kwargs))
    got, error = _outcome(lambda: op(*args, **kwargs))
    if oracle_error is not None or error is not None:
        assert type(error) is type(oracle_error), f"{op.__name__}: ran: {error!r}, oracle: {oracle_error!r}"
        return "raises"
    want = first_floating(plain) if expected.left_to_torch else expected.dtype
    if expected.left_to_torch:
        assert plain_error is None, f"{op.__name__}: left to torch, and torch raises {plain_error!r}"
    assert first_floating(got) == want, f"{op.__name__}: ran in {first_floating(got)}, expected {want} ({expected})"
    if not expected.left_to_torch and recorded is not None and ran and not _delegated(ran[0].name):
        where = ran[0] if unwrap(op) is not op else _cast_at(ran[0])  # op left as torch's: its builtin casts
        if where is ran[0] and unwrap(op) is op and not SEES_BODIES:
            return "cast"  # the builtin inside runs unseen: this torch has no torch.overrides.redispatch_function
        assert where.inputs == expected.received, f"{op.__name__}: received {where}, expected {expected}"
    return "left to torch" if expected.left_to_torch else "cast"


@pytest.mark.parametrize("config", CONFIGS)
def test_expected_dtype_agrees_with_what_runs_for_every_listed_op(config, tmp_path):
    """Done when (issue 49): for the default O1, O2 and strict lists and a user file moving softmax
    to BF16, expected_dtype agrees with what runs on drawn calls of every listed op (mixed dtypes,
    edge values)."""
    _convert(config, tmp_path)
    names = _listed_ops()
    assert len(names) > 60 and not [n for n in names if hst.builder(n) is None]  # hmp's builder, or a probe's
    seen = {}

    @DRAWS
    @given(st.data())
    def every_op(data):
        for name in names:
            args, kwargs = data.draw(hst.calls(name, edges=True), label=name)
            seen.setdefault(_agrees(hst.op_for(name), args, kwargs), set()).add(name)

    every_op()
    assert len(set().union(*seen.values())) == len(names)
    assert ("softmax" in seen["cast"]) and (config == "O2" or "mm" in seen["cast"])
    if config == "softmax in BF16":
        x = torch.randn(3, 4)
        assert expected_dtype(F.softmax, x, -1) == BF16 == F.softmax(x, -1).dtype


def test_the_rules_case_by_case(tmp_path):
    x, b = torch.randn(3, 3), torch.randn(3, 3).bfloat16()
    assert expected_dtype(torch.mm, x, x) is None  # not converted
    hmp.convert()
    assert expected_dtype(torch.mm, x, x) == BF16 and expected_dtype(x.mm, x) == BF16
    assert expected_dtype(torch.addmm, x, x, x, beta=3.4e38) == FP32  # a number beyond bf16: the FP32 rule
    assert expected_dtype(torch.mm, x, x, out=torch.empty(3, 3, dtype=FP64)) == FP64  # the written tensor's
    assert expected_dtype(F.softmax, b, -1) == FP32 and expected_dtype(lambda t: t @ t, x) is None
    assert expected_dtype(torch.add, x, b) is None  # promote list, torch promotes it itself
    assert expected_call(torch.add, x, b).rule.startswith("left to torch: promote list entry add")
    assert expected_dtype(torch.linalg.inv, b) == FP32  # in no list, no bf16 kernel: the FP32 rule
    assert expected_dtype(torch.Tensor.index_put_, x.clone(), (torch.tensor([0]),), b[0]) == FP32
    with hmp.disable_casts():
        assert expected_dtype(torch.mm, x, x) is None

    @hmp.fp32_function
    def mine(t):
        return t * 2

    assert expected_dtype(mine, b) == FP32 == mine(b).dtype
    (tmp_path / "promote.txt").write_text("cat\n")
    hmp.convert(promote_file_path=tmp_path / "promote.txt")  # index_put: in no list, and it needs one dtype
    assert expected_dtype(torch.index_put, x, (torch.tensor([0]),), b[0]) == FP32


def test_expected_dtype_runs_torchs_op_on_copies_with_the_random_stream_put_back():
    hmp.convert(strict=True)
    x = torch.randn(64, 64)
    before, state = x.clone(), torch.get_rng_state()
    assert expected_dtype(F.dropout, x, 0.5, True) == BF16
    assert expected_dtype(F.relu, x, inplace=True) == FP32  # in place: the written tensor's dtype
    assert torch.equal(x, before) and torch.equal(torch.get_rng_state(), state)


def test_an_op_without_a_kernel_for_its_lists_dtype_is_expected_as_hmp_runs_it(tmp_path):
    (tmp_path / "bf16.txt").write_text("include default\npdist\n")
    hmp.convert(bf16_file_path=tmp_path / "bf16.txt")
    x = torch.randn(4, 3)
    expected = expected_call(torch.pdist, x)
    assert expected.rescued and "BFloat16" in expected.rescued and expected.dtype == FP32
    with pytest.warns(RuntimeWarning, match="fails on the dtype hmp cast"):
        assert torch.pdist(x).dtype == FP32


def test_assert_runs_as_fails_on_a_wrong_dtype_and_names_what_ran():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Softmax(-1))
    x = torch.randn(2, 4)
    hmp.convert()
    out = assert_runs_as(model, x, expect={"linear": BF16, "layer_norm": BF16, "softmax": FP32})
    assert out.dtype == FP32
    with pytest.raises(AssertionError, match=r"linear: expected float32, 1 of 1 calls were not: linear\(bfloat16"):
        assert_runs_as(model, x, expect={"linear": FP32})
    with pytest.raises(AssertionError, match="conv2d never ran"):
        assert_runs_as(model, x, expect={"conv2d": BF16})
    with record_ops() as ran:
        x @ x.t()
    assert [(r.name, r.dtype) for r in ran] == [("t", FP32), ("matmul", BF16)]


def test_follow_catches_a_cast_that_breaks_a_rule(monkeypatch):
    """Planted in hmp's casts, found by the kit: a cast to the wrong dtype, then one that lets a
    finite value become inf."""
    x = torch.randn(3, 3)
    monkeypatch.setitem(cast_copies.FINITE_CASTS, BF16, cast_copies.ROUNDING_CASTS[FP16])
    hmp.convert(cache=False)
    with pytest.raises(AssertionError, match="ran in float16, the rules say bfloat16"):
        assert_follows_rules(torch.mm, x, x)
    monkeypatch.setitem(cast_copies.FINITE_CASTS, BF16, cast_copies.ROUNDING_CASTS[BF16])
    hmp.convert(cache=False)
    big = torch.full((3, 3), 3.4e38)  # beyond bfloat16's largest finite value: a plain cast gives inf
    with pytest.raises(AssertionError, match=r"the finite value 3\.3999\d*e\+38 reached the op as inf"):
        assert_follows_rules(torch.mm, big, torch.eye(3))
    monkeypatch.undo()
    hmp.convert()
    assert follow(torch.mm, big, torch.eye(3)).dtype == BF16


def test_strategies_draw_edge_values_and_finite_ones_by_default():
    edges = hst.tensors(FP32, (16,), edges=True)
    assert torch.isinf(find(edges, lambda t: bool(torch.isinf(t).any()))).any()
    assert torch.isnan(find(edges, lambda t: bool(torch.isnan(t).any()))).any()
    beyond = find(edges, lambda t: bool(((t.abs() > torch.finfo(BF16).max) & t.isfinite()).any()))
    assert beyond.isfinite().any()

    @DRAWS
    @given(hst.tensors((FP32, BF16)))
    def finite(t):
        assert t.dtype in (FP32, BF16) and bool(t.isfinite().all())

    finite()


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_sample_call_runs_in_plain_torch(name):
    op = hst.op_for(name)
    assert op is not None and hst.builder(op) is BUILDERS[name] and hst.builder(name) is BUILDERS[name]

    @settings(max_examples=3, derandomize=True, database=None, deadline=None)
    @given(hst.calls(op, dtypes=(FP32,)))
    def runs(call):
        args, kwargs = call
        op(*args, **kwargs)

    runs()


def test_every_op_of_every_shipped_list_has_sample_calls():
    names = set()
    for kwargs in ({}, {"opt_level": "O2"}, {"strict": True}, {"low_precision_type": FP16}):
        with hmp.converted(**kwargs):
            names |= set(_listed_ops())
    assert not sorted(n for n in names if hst.builder(n) is None)  # hmp's builder, or a probe's that runs
    with pytest.raises(LookupError, match="no sample calls for 'pixel_shuffle'"):
        hst.calls(F.pixel_shuffle)  # needs an upscale factor: no call with tensors alone runs
    assert hst.builder(torch.sinh) is not None  # an op hmp has no builder for: a call with one tensor runs


def test_check_lists_says_what_each_entry_does(tmp_path):
    bf16 = tmp_path / "bf16.txt"
    bf16.write_text("include default\nsoftmax\npdist\ncdist\nrelu\n")
    report = check_lists(bf16, examples=3, only={"mm", "softmax", "pdist", "cdist", "relu", "add", "index_put"})
    says = {v.name: v for v in report.verdicts}
    assert says["mm"].ok and says["mm"].says.startswith("cast: ran in bfloat16")
    assert says["softmax"].says.startswith("cast: ran in bfloat16") and says["softmax"].kind == "bf16"
    assert "no bfloat16 kernel" in says["pdist"].says and says["pdist"].ok
    assert "no bfloat16 kernel" in says["cdist"].says and says["cdist"].ok  # torch.cdist, a Python function
    assert says["relu"].ok and says["relu"].says.startswith("not cast outside strict mode: pointwise")
    assert says["add"].ok and says["index_put"].says.startswith("cast: ran in float32")
    assert str(report).splitlines()[-1].startswith("7 entries:")
    assert not hmp.is_converted()


def test_the_default_lists_pass_the_check():
    report = check_lists(examples=2)
    assert report.ok, str(report)
    assert {v.status for v in report.verdicts} == {"ok", "module"} and len(report.verdicts) > 60
    assert all(v.says.startswith("module entry") for v in report.verdicts if v.status == "module")


def test_python_m_hmp_check(tmp_path, capsys):
    assert main(["check", "--only", "mm", "softmax", "--examples", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("hmp check: torch ") and lines[-1] == "2 entries: 2 ok, 0 failed, 0 skipped"
    assert re.match(r"bf16 +mm +ok +cast: ran in bfloat16 \(2\)", lines[1]), lines
    assert main(["check", str(tmp_path / "missing.txt")]) == 2
    assert "python -m hmp check: error: " in capsys.readouterr().err
    assert not hmp.is_converted()


PLUGIN_TESTS = """
import pytest, torch
import hmp
from hypothesis import given, settings
from hmp.testing import assert_runs_as, strategies as hst

@pytest.mark.hmp(bf16_file_path="my_bf16.txt")
def test_marker_alone():
    assert hmp.effective_lists(detail=True)["bf16"]["softmax"] == "cast"

def test_next_is_unconverted():
    assert not hmp.is_converted()

def test_fixture(hmp_converted):
    assert hmp.is_converted() and hmp_converted["bf16"]["mm"] == "cast"

@pytest.mark.hmp(opt_level="O2")
class TestClass:
    @pytest.mark.hmp(strict=True)
    def test_merged(self):
        assert hmp.effective_lists(detail=True)["fp32"]["relu"] == "cast"  # O2's list, strict mode

@pytest.mark.hmp
@settings(max_examples=3, deadline=None)
@given(hst.listed_calls())
def test_given(call):
    assert hmp.is_converted()

@pytest.mark.hmp
def test_leaves_casts_off():
    hmp.disable_casts().__enter__()

def test_after_casts_off():
    assert hmp.casts_enabled() and not hmp.is_converted()

KEPT = []

@pytest.mark.hmp
def test_leaves_a_block_open():
    KEPT.append(hmp.converted(opt_level="O2"))  # kept: a block dropped is closed by the garbage collector
    KEPT[-1].__enter__()

def test_after_the_block():
    assert not hmp.is_converted()

@pytest.mark.hmp
def test_wrong_dtype():
    x = torch.randn(2, 2)
    assert_runs_as(torch.mm, x, x, expect={"mm": torch.float32})
"""


def _plugin_installed():
    """As pytest looks: the pytest11 entry points of every distribution found (a stale copy of hmp's
    metadata in a checkout may come first on the path)."""
    return any(
        ep.group == "pytest11" and ep.value == "_hmp_pytest"
        for dist in importlib.metadata.distributions()
        for ep in dist.entry_points
    )


needs_plugin = pytest.mark.skipif(not _plugin_installed(), reason="hmp is not installed with its entry points here")


@needs_plugin
def test_the_plugin_converts_for_one_test_and_fails_a_test_that_leaves_hmp_behind(tmp_path):
    (tmp_path / "my_bf16.txt").write_text(SOFTMAX_IN_BF16)
    (tmp_path / "test_users.py").write_text(PLUGIN_TESTS)
    done = run_python("-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_users.py", cwd=tmp_path, timeout=300)
    outcome = {name: status for status, name in re.findall(r"^(PASSED|FAILED) test_users.py::(\S+)", done.stdout, re.M)}
    passed = ["test_marker_alone", "test_next_is_unconverted", "test_fixture", "TestClass::test_merged", "test_given"]
    passed += ["test_after_casts_off", "test_after_the_block"]
    failed = ["test_leaves_casts_off", "test_leaves_a_block_open", "test_wrong_dtype"]
    assert outcome == {**dict.fromkeys(passed, "PASSED"), **dict.fromkeys(failed, "FAILED")}, done.stdout[-3000:]
    assert "hmp: the test left hmp's casts off" in done.stdout and "hmp: the test left hmp converted" in done.stdout
    assert "mm: expected float32" in done.stdout and "3 failed, 7 passed" in done.stdout


@needs_plugin
def test_pytests_start_imports_neither_hmp_nor_torch(tmp_path):
    (tmp_path / "test_plain.py").write_text(
        "import sys\n\ndef test_plain():\n    assert not {'torch', 'hmp'} & set(sys.modules), sorted(sys.modules)\n"
    )
    done = run_python(
        "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "test_plain.py", cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-2000:]
    with_plugin = run_python("-m", "pytest", "--trace-config", "-p", "no:cacheprovider", "test_plain.py", cwd=tmp_path)
    assert "_hmp_pytest" in with_plugin.stdout


WITHOUT_HYPOTHESIS = """
import sys, hmp
print(sorted(m for m in ("hmp.testing", "_hmp_pytest", "pytest", "hypothesis") if m in sys.modules))
sys.modules["hypothesis"] = None  # as when it is not installed
import hmp.testing as kit
print(kit.expected_dtype.__name__)
try:
    kit.strategies
except ImportError as e:
    print(e)
"""


def test_import_hmp_imports_nothing_of_the_kit_and_the_kit_needs_hypothesis_only_for_strategies(tmp_path):
    done = run_python("-c", WITHOUT_HYPOTHESIS, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["[]", "expected_dtype"] and "needs hypothesis: pip install hypothesis" in lines[2]
