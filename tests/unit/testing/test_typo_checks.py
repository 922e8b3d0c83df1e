"""A typo cannot turn a check green or pass unnoticed: a name ``check --only`` / ``check_lists(only=)``
is given that no list holds is an error naming it, with close matches; a ``-name`` line that takes
nothing out warns naming its file and line, for every kind of list file; a TARGET that cannot be
called as the docs say (a function needing arguments, a file that is not Python) is one ``error:``
line and exit 2, while an exception from the user's own code keeps its traceback. And the
terminal tables say what was measured: an op that casts nothing shows no own error, not 0."""

import inspect
import sys
import warnings

import pytest
import torch
from helpers.models import ConvNorm

import hmp
from hmp.__main__ import main
from hmp.binding import uncast_list
from hmp.testing import check_lists
from hmp.tools import profile_cli
from hmp.tools.profiling import profile

# --- check --only ---------------------------------------------------------------------------------


def test_a_name_no_list_holds_is_an_error_naming_it_with_close_matches():
    with pytest.raises(ValueError) as e:
        check_lists(only={"softmaxx"}, examples=1)
    message = str(e.value)
    assert "'softmaxx'" in message and "did you mean softmax" in message
    assert not hmp.is_converted()


def test_every_missing_name_is_named_and_nothing_is_checked(tmp_path):
    hmp.convert(fp32_file_path="")
    before = hmp.effective_lists()
    try:
        with pytest.raises(ValueError) as e:
            check_lists(only=["softmax", "cumsum", "relux"], examples=1)
        assert "'cumsum'" in str(e.value) and "'relux'" in str(e.value) and "'softmax'" not in str(e.value)
        assert hmp.effective_lists() == before  # the conversion in force is as it was
    finally:
        hmp.revert()


def test_only_takes_one_name_as_a_string_and_refuses_an_empty_set():
    report = check_lists(only="softmax", examples=1)
    assert [v.name for v in report.verdicts] == ["softmax"] and report.ok
    with pytest.raises(ValueError, match="names no entry"):
        check_lists(only=[], examples=1)
    with pytest.raises(TypeError, match="only must hold entries' names"):
        check_lists(only=[torch.softmax], examples=1)


def test_check_only_with_a_typo_is_one_error_line_and_exit_2(capsys):
    assert main(["check", "--only", "softmaxx", "--examples", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m hmp check: error: ")
    assert "'softmaxx' (did you mean softmax" in err[0]


# --- '-name' lines that take nothing out ------------------------------------------------------------


def _loaded(**files):
    """The warnings hmp.convert(**files) gives, and the effective lists."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        hmp.convert(**files)
    try:
        return [str(w.message) for w in seen if issubclass(w.category, UserWarning)], hmp.effective_lists()
    finally:
        hmp.revert()


def _takes_out_nothing(said):
    return [s for s in said if "out nothing" in s]


def test_a_minus_line_that_takes_nothing_out_warns_naming_file_and_lines(tmp_path):
    path = tmp_path / "m.txt"
    path.write_text("include default\n-softmax\n-linear\n-cumsum\n")
    said, lists = _loaded(bf16_file_path=str(path))
    inert = _takes_out_nothing(said)
    assert len(inert) == 1, said
    assert str(path) in inert[0] and "line 2: '-softmax'" in inert[0] and "line 4: '-cumsum'" in inert[0]
    assert "-linear" not in inert[0]  # that one takes linear out
    assert "linear" not in lists["bf16"] and "softmax" in lists["fp32"]  # the rest loads as written


@pytest.mark.parametrize(
    "parameter, text, inert, useful",
    [
        ("fp32_file_path", "include default\n-topk\n-cumsum\n", "-cumsum", "-topk"),
        (
            "fp32_file_path",
            "include default\n-diffusers.models.embeddings.Timesteps\n-nosuchlib_hmp.Block\n",
            "-nosuchlib_hmp.Block",
            "-diffusers",
        ),
        ("promote_file_path", "include default\n-lerp\n-linear\n", "-linear", "-lerp"),
    ],
)
def test_every_list_kind_warns_for_a_minus_line_that_takes_nothing_out(tmp_path, parameter, text, inert, useful):
    path = tmp_path / "list.txt"
    path.write_text(text)
    said = _takes_out_nothing(_loaded(**{parameter: str(path)})[0])
    assert len(said) == 1 and inert in said[0] and useful not in said[0], said


def test_a_file_whose_minus_lines_all_take_something_out_does_not_warn(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("include default\n-topk\n-transformers.models.*.modeling_*.*RotaryEmbedding\n")
    assert not _takes_out_nothing(_loaded(fp32_file_path=str(path))[0])


def test_the_uncast_calls_file_warns_too(tmp_path):
    path = tmp_path / "u.txt"
    path.write_text("include default\n-nosuchlib_hmp.tools.merge\n")
    with pytest.warns(UserWarning, match=r"line 2: '-nosuchlib_hmp.tools.merge'.*out nothing"):
        entries = uncast_list.load(str(path))
    assert entries == uncast_list.load("")  # the default's entries, nothing taken out


# --- TARGET ------------------------------------------------------------------------------------------

TARGETS = """
import torch

def make(name, seed=0):
    model = torch.nn.Linear(4, 2)
    return lambda: model(torch.ones(1, 4)).sum(), (model,)

def make_keyword_only(*, width):
    return make("x")

def make_that_raises():
    raise TypeError("the user's own bug")
"""


@pytest.fixture
def targets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # tune writes its outputs here (it gets no further)
    monkeypatch.setattr(sys, "path", list(sys.path))  # a FILE.py target puts its folder first
    (tmp_path / "user_models.py").write_text(TARGETS)
    (tmp_path / "broken.py").write_text("def make(:\n    pass\n")
    yield tmp_path
    for name in ("user_models", "broken"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("command", ["tune", "audit", "profile"])
@pytest.mark.parametrize(
    "target, says",
    [
        ("user_models.py:make", "make() needs arguments (name)"),
        ("user_models:make", "make() needs arguments (name)"),
        ("user_models.py:make_keyword_only", "make_keyword_only() needs arguments (width)"),
        ("broken.py:make", "broken.py, line 1: SyntaxError"),
        ("broken:make", "broken.py, line 1: SyntaxError"),
    ],
)
def test_a_target_that_cannot_be_called_as_the_docs_say_is_one_error_line(targets, capsys, command, target, says):
    assert main([command, target]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"python -m hmp {command}: error: TARGET {target!r}: "), err
    assert says in err[0]
    assert "broken" not in sys.modules  # no half-loaded module left behind


def test_an_exception_from_the_users_own_target_keeps_its_traceback(targets):
    with pytest.raises(TypeError, match="the user's own bug") as e:
        main(["audit", "user_models.py:make_that_raises"])
    assert any(frame.name == "make_that_raises" for frame in e.traceback)


# --- what the tables and help say --------------------------------------------------------------------


def test_the_audit_table_shows_no_own_error_for_an_op_that_casts_nothing():
    torch.manual_seed(0)
    net, x = ConvNorm(), torch.randn(2, 3, 8, 8)
    report = hmp.audit(lambda: net(x), state=(net,), progress=False)
    row = next(r for r in report.rows if r["op"] == "batch_norm")
    assert row["casts"] == 0 and row["list"] is None  # bf16 in from conv2d: nothing to cast
    line = next(line for line in report.table().splitlines() if line.startswith("| batch_norm |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "none, ran in bfloat16" and cells[5] == "-" and cells[7] == "-", line
    assert "None" not in line
    assert "-: the op casts nothing" in report.table()


def test_profile_help_says_how_many_times_the_step_runs(capsys):
    runs = []
    model = torch.nn.Linear(4, 2)

    def step():
        runs.append(1)
        return model(torch.ones(1, 4)).sum()

    with hmp.converted():
        profile(step, state=(model,), progress=False)
    assert len(runs) == profile_cli.REPEATS + 1
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    assert f"step {len(runs)} times under the lists" in " ".join(capsys.readouterr().out.split())
    assert inspect.signature(profile).parameters["repeats"].default == profile_cli.REPEATS
