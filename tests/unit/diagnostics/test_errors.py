"""Errors that help: an exception from a wrapped op keeps its type, message
and identity; a bf16/fp32 dtype mismatch gains one note naming the op and
the list it probably belongs in; convert() inside torch.autocast warns once."""

import importlib
import os
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same, release_lines_removed, release_said, run_python, snapshot, write

import hmp
from hmp.diagnostics import errors

BF16, FP32 = torch.bfloat16, torch.float32
ROOT = Path(__file__).resolve().parents[3]
needs_notes = pytest.mark.skipif(sys.version_info < (3, 11), reason="add_note is Python 3.11+")


def notes(e):
    return [n for n in getattr(e, "__notes__", ()) if n.startswith("hmp:")]


def plain_error(fn):
    """The exception torch raises for the same call without hmp."""
    with hmp.disable_casts():
        with pytest.raises(Exception) as info:
            fn()
    return info.value


# -- type, message and identity are kept -------------------------------------------------


class Boom(Exception):
    pass


class Raises(torch.Tensor):
    """A subclass whose ops raise a user exception from inside the wrapped call."""

    raised = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("mm", "softmax", "add", "mul_"):
            e = Boom(f"boom in {func.__name__}")
            cls.raised.append(e)
            raise e
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("call", ["mm", "softmax", "add", "mul_"])
def test_exception_inside_wrapped_op_is_the_same_object(call):
    hmp.convert()
    x = torch.randn(3, 3).as_subclass(Raises)
    fn = {
        "mm": lambda: torch.mm(x, x),
        "softmax": lambda: torch.softmax(x, -1),
        "add": lambda: torch.add(x, x),
        "mul_": lambda: x.mul_(2),
    }[call]
    with pytest.raises(Boom) as info:
        fn()
    assert info.value is Raises.raised[-1] and str(info.value) == f"boom in {call}"
    assert not notes(info.value) and hmp.casts_enabled()


@pytest.mark.parametrize("case", ["shape", "index", "dim", "int softmax", "overlap"])
def test_torch_errors_keep_type_and_message(case):
    hmp.convert()
    x = torch.randn(3, 4)
    fn = {
        "shape": lambda: torch.mm(x, x),
        "index": lambda: F.embedding(torch.tensor([9]), torch.randn(3, 2)),
        "dim": lambda: F.softmax(x.bfloat16(), dim=5),
        "int softmax": lambda: torch.softmax(torch.ones(3, dtype=torch.long), 0),
        "overlap": lambda: torch.randn(3, 1).expand(3, 4).mul_(x),
    }[case]
    expected = plain_error(fn)
    with pytest.raises(type(expected)) as info:
        fn()
    assert type(info.value) is type(expected)
    # the message may differ only in the dtype hmp cast to
    norm = lambda s: s.replace("BFloat16", "Float").replace("bfloat16", "float32")  # noqa: E731
    assert norm(str(info.value)) == norm(str(expected))
    assert not notes(info.value)  # not a dtype mismatch: no note
    assert hmp.casts_enabled()


def test_keyboard_interrupt_inside_wrapped_op_passes_untouched():
    class Interrupt(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "mm":
                raise KeyboardInterrupt
            return super().__torch_function__(func, types, args, kwargs or {})

    hmp.convert()
    x = torch.randn(2, 2).as_subclass(Interrupt)
    with pytest.raises(KeyboardInterrupt):
        torch.mm(x, x)
    assert hmp.casts_enabled() and torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == BF16


# -- dtype mismatches name the op ----------------------------------------------------------


@needs_notes
def test_mismatch_in_a_wrapped_norm_names_it_and_a_list():
    """batch_norm is in no list (a normalisation in the BF16 list casts only
    under strict): it runs as torch runs it, which here raises, with a note."""
    hmp.convert()
    x = torch.randn(4, 8)
    mean, var = torch.zeros(8).bfloat16(), torch.ones(8)  # a half-converted BatchNorm
    w, b = torch.ones(8), torch.zeros(8)
    expected = plain_error(lambda: F.batch_norm(x, mean, var, w, b, training=True))  # the call as given
    with pytest.raises(RuntimeError) as info:
        F.batch_norm(x, mean, var, w, b, training=True)
    e = info.value
    assert str(e) == str(expected)  # message unchanged
    (note,) = notes(e)
    assert note.startswith("hmp: batch_norm got") and "FP32 list" in note and "'batch_norm'" in note


def test_half_converted_layer_norm_runs_where_its_kernel_rejects_the_mix():
    """layer_norm is left to torch (a normalisation gains nothing from bf16);
    where its kernel rejects the mix it is given, hmp puts it in one dtype,
    the widest, as torch's promotion gives (see sites.one_dtype_on_reject)."""
    x, w, b = torch.randn(4, 8), torch.ones(8).bfloat16(), torch.zeros(8)
    with pytest.raises(RuntimeError, match="dtype"):
        F.layer_norm(x, (8,), w, b)  # plain torch
    hmp.convert()
    out = F.layer_norm(x, (8,), w, b)
    assert out.dtype == torch.float32 and torch.equal(out, F.layer_norm(x, (8,), w.float(), b))
    hmp.convert(strict=True)  # Habana's rule casts the input down: weight and bias follow it
    assert F.layer_norm(x, (8,), w, b).dtype == torch.bfloat16


@needs_notes
def test_mismatch_inside_op_wrap_names_the_inner_op():
    hmp.convert()
    w = torch.randn(4, 4)

    def project(x):
        return torch.mm(x, w)  # w is not an argument: never cast; a multi-line call

    wrapped = hmp.op_wrap(project, hmp.to_bf16)
    with pytest.raises(RuntimeError) as info:
        wrapped(torch.randn(2, 4))
    (note,) = notes(info.value)
    assert note.startswith("hmp: mm got") and "project" in note and "cast their inputs inside it" in note


@needs_notes
def test_mismatch_in_an_op_called_inside_a_wrapped_python_op():
    """Ops called inside a wrapped op are not cast again: a tensor made
    inside it stays fp32 and meets the cast bf16 argument."""
    hmp.convert()

    def inner(x):
        bias = torch.zeros(x.shape[-1])  # made inside: fp32
        return torch.baddbmm(bias, x[None], x[None].transpose(1, 2))

    wrapped = hmp.op_wrap(inner, hmp.to_bf16)
    with pytest.raises(RuntimeError) as info:
        wrapped(torch.randn(3, 3))
    (note,) = notes(info.value)
    assert "baddbmm" in note and "inner" in note


def test_a_listed_python_op_that_fails_on_its_casts_runs_as_given(monkeypatch):
    """A listed op implemented in Python (the site label is what convert() gives
    the wrapper) whose inner call mixes the dtypes hmp cast to: the call runs
    again as given (no op fails because of a cast hmp made), with one warning."""
    from hmp.binding import wrapper_life
    from hmp.core import cast_copies, policy, rescue, state

    monkeypatch.setattr(state, "warned", release_said())
    hmp.convert()

    def attention(q, k):
        scale = torch.ones(q.shape[0], q.shape[0])  # made inside: fp32
        return torch.baddbmm(scale[None], q[None], k[None].transpose(1, 2))

    about = rescue.About("torch.nn.functional.attention", "attention", "bf16")
    wrapped = wrapper_life.make(attention, policy.lower(BF16, dict(cast_copies.ROUNDING_CASTS)), about)
    q, k = torch.randn(3, 2), torch.randn(3, 2)
    with pytest.warns(RuntimeWarning, match="attention fails on the dtype hmp cast its inputs to.*as given"):
        out = wrapped(q, k)
    with hmp.disable_casts():
        assert torch.equal(out, attention(q, k))


@needs_notes
def test_mismatch_inside_a_listed_python_op_says_to_list_what_it_calls():
    """The same op where running it again cannot help: given a bf16 q it mixes
    dtypes as given too, and it writes q, so it never runs on float32 copies."""
    from hmp.binding import wrapper_life
    from hmp.core import cast_copies, policy, rescue

    hmp.convert()

    def attention(q, k):
        scale = torch.ones(q.shape[0], q.shape[0])  # made inside: fp32
        return torch.baddbmm(scale[None], q[None], k[None].transpose(1, 2))

    about = rescue.About("torch.nn.functional.attention", "attention", "bf16", inplace=True)
    wrapped = wrapper_life.make(attention, policy.lower(BF16, dict(cast_copies.ROUNDING_CASTS)), about)
    with pytest.raises(RuntimeError) as info:
        wrapped(torch.randn(3, 2).bfloat16(), torch.randn(3, 2))
    (note,) = notes(info.value)
    assert note.startswith("hmp: baddbmm got") and "inside torch.nn.functional.attention (BF16 list)" in note
    assert "take 'attention' out of the lists" in note and "'baddbmm' probably belongs in the BF16 list" in note


def _unwrapped_note(fn):
    """The note errors.explain gives an error that passed through nothing
    hmp wraps (what ``python -m hmp run`` adds to the script's uncaught error)."""
    with pytest.raises(Exception) as info:
        fn()
    e = info.value
    assert not notes(e)  # nothing of hmp's saw it: no note
    note = errors.explain(e)
    assert notes(e) == [note] and errors.explain(e) == note  # added once
    return note


@pytest.fixture
def no_fallback(monkeypatch):
    """The ops these notes are about (an op in no list given mixed dtypes)
    are covered by the shipped fallback lists (lists.fallback_names); the
    note is for every op they do not cover, so the tests take them away."""
    monkeypatch.setattr(hmp.binding.lists, "fallback_names", lambda low: ())


@needs_notes
def test_unlisted_op_called_directly_is_named(no_fallback):
    hmp.convert()
    bias, a, b = torch.randn(3, 3), torch.randn(1, 3, 3).bfloat16(), torch.randn(1, 3, 3).bfloat16()
    note = _unwrapped_note(lambda: torch.addbmm(bias, a, b))
    assert "addbmm" in note and "no hmp list" in note and "BF16 list" in note and "bf16_file_path" in note


@needs_notes
def test_op_removed_from_the_lists_is_named_with_its_list(tmp_path, no_fallback):
    hmp.convert(
        bf16_file_path=write(tmp_path, "b.txt", "linear\nmm\n"),  # no addmm
        promote_file_path=write(tmp_path, "p.txt", "add\n"),
    )  # no index_put
    x, w, bias = torch.randn(2, 3).bfloat16(), torch.randn(3, 4).bfloat16(), torch.randn(4)
    note = _unwrapped_note(lambda: torch.addmm(bias, x, w))
    assert "addmm" in note and "no hmp list" in note and "BF16 list" in note
    # an operator and a method call are named too
    note = _unwrapped_note(lambda: x.float() @ w)
    assert "matmul" not in hmp.effective_lists()["bf16"] and "hmp: matmul got" in note
    note = _unwrapped_note(lambda: bias.index_put_((torch.tensor([0]),), torch.ones(1).bfloat16()))
    assert "index_put" in note and "promote list" in note


@needs_notes
def test_listed_op_not_cast_says_why():
    """A listed op called with casts off for a block: its wrapper notes the error in every process
    (not only under ``python -m hmp run``), naming the block and the fix."""
    hmp.convert()
    a, b = torch.randn(2, 2), torch.randn(2, 2).bfloat16()
    with hmp.disable_casts():
        with pytest.raises(RuntimeError) as info:
            torch.mm(a, b)
    (note,) = notes(info.value)
    assert note.startswith("hmp: torch.mm (BF16 list) ran uncast") and "disable_casts" in note
    assert "cast the input in the block" in note and "widen the block" in note


@needs_notes
def test_a_layer_inside_disable_casts_given_a_bf16_activation_is_explained():
    """The natural mistake: an activation made bf16 before the block reaches a layer inside it."""
    hmp.convert()
    lin1, lin2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
    h = lin1(torch.randn(2, 8))
    with hmp.disable_casts(), pytest.raises(RuntimeError) as info:
        lin2(h)
    assert [n for n in notes(info.value) if "linear (BF16 list) ran uncast" in n]


@needs_notes
def test_a_call_inside_a_wrapped_op_is_noted_by_that_op_not_as_uncast():
    """Casts are off inside a wrapped op too: there the enclosing wrapper's note says what happened."""
    hmp.convert()

    @hmp.bf16_function
    def mixed(a):
        return torch.mm(a, torch.randn(2, 2))  # a bf16 (cast by the function's rule) and a float32 tensor

    with pytest.raises(RuntimeError) as info:
        mixed(torch.randn(2, 2))
    assert not [n for n in notes(info.value) if "ran uncast" in n]


@needs_notes
def test_mismatch_that_names_no_op_gets_a_generic_line():
    call = torch.addbmm  # taken before convert(): never cast; called by a name that is no op
    hmp.convert()
    bias, a, b = torch.randn(3, 3), torch.randn(1, 3, 3).bfloat16(), torch.randn(1, 3, 3).bfloat16()
    note = _unwrapped_note(lambda: call(bias, a, b))
    assert "missing from hmp's lists" in note


def test_non_mismatch_errors_get_no_note():
    hmp.convert()
    with pytest.raises(RuntimeError) as info:
        torch.sin(torch.randn(2, 3)).view(5)
    errors.annotate(info.value)
    assert errors.explain(info.value) is None and not notes(info.value)


@needs_notes
def test_explain_adds_nothing_when_not_converted(no_fallback):
    """The lists a note names are the conversion's: without one, no note."""
    bias, a = torch.randn(2, 2), torch.randn(1, 2, 2).bfloat16()
    with pytest.raises(RuntimeError) as info:
        torch.addbmm(bias, a, a)
    assert errors.explain(info.value) is None and not notes(info.value)


# a script whose dtype mismatch is raised by an op in no list, called directly
# (never through an hmp wrapper), or with --listed by a listed op (through its wrapper)
MISMATCH_SCRIPT = """\
import sys, threading, torch, hmp
import torch.nn.functional as F
hmp.binding.lists.fallback_names = lambda low: ()  # an op the fallback lists do not cover
hmp.convert(strict="--listed" in sys.argv)  # strict: batch_norm is cast, through its wrapper
bias, a = torch.randn(2, 2), torch.randn(1, 2, 2).bfloat16()
def step():
    if "--listed" in sys.argv:  # a half-converted BatchNorm: batch_norm's wrapper notes it
        F.batch_norm(torch.randn(4, 2), torch.zeros(2).bfloat16(), torch.ones(2), training=True)
    torch.addbmm(bias, a, a)
t = threading.Thread(target=step); t.start(); t.join()
print("thread done", flush=True)
step()
"""
UNLISTED = "hmp: addbmm got lower-precision and float32 tensors and is in no hmp list"
LISTED = "hmp: torch.nn.functional.batch_norm (BF16 list) got lower-precision and float32 tensors"


def _run(tmp_path, *args, runner=()):
    """The script's exit under ``python`` (or ``python *runner``)."""
    script = tmp_path / "train.py"
    script.write_text(MISMATCH_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = run_python(*runner, str(script), *args, cwd=tmp_path, env=env)
    assert res.returncode == 1, res.stderr
    return res


@needs_notes
def test_plain_script_notes_a_listed_ops_error_but_not_an_unlisted_ops(tmp_path):
    """hmp replaces no exception hook: an op in no list, called outside
    anything hmp wraps, gets no note in a plain python process (main thread
    or another); a listed op's error is noted by its wrapper."""
    res = _run(tmp_path)
    assert "thread done" in res.stdout and res.stderr.count("must have the same dtype") == 2  # torch's message
    assert "hmp:" not in release_lines_removed(res.stderr)
    res = _run(tmp_path, "--listed")
    assert res.stderr.count(LISTED) == 2 and UNLISTED not in res.stderr


@needs_notes
def test_unlisted_op_called_directly_is_named_under_hmp_run(tmp_path):
    """python -m hmp run rescues the script's uncaught error: it gets the note
    (an error in another thread is reported by threading.excepthook: none)."""
    res = _run(tmp_path, runner=("-m", "hmp", "run"))
    assert "thread done" in res.stdout and res.stderr.count("must have the same dtype") == 2
    assert res.stderr.count(UNLISTED) == 1


def test_convert_leaves_the_exception_hooks_alone():
    before = (sys.excepthook, threading.excepthook)
    hmp.convert()
    assert sys.excepthook is before[0] and threading.excepthook is before[1]
    hmp.convert(opt_level="O2")
    assert sys.excepthook is before[0] and threading.excepthook is before[1]
    hmp.revert()
    assert sys.excepthook is before[0] and threading.excepthook is before[1]


# -- autocast --------------------------------------------------------------------------------


@pytest.fixture
def fresh_autocast_warning(monkeypatch):
    monkeypatch.setattr(importlib.import_module("hmp.core.state"), "warned", release_said())


def test_convert_inside_autocast_warns_once(fresh_autocast_warning):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hmp.convert()  # outside autocast: silent
    with torch.autocast("cpu", dtype=BF16):
        with pytest.warns(UserWarning, match=r"inside an active torch.autocast region \(cpu\)") as record:
            hmp.convert()
        assert record[0].filename == __file__  # points at the convert() call
        msg = str(record[0].message)
        assert "autocast's lists win" in msg and "FP32 list" in msg and "once per process" in msg
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            hmp.convert()  # second time: silent
    assert hmp.is_converted()


def test_converting_again_on_the_autocast_engine_is_not_inside_a_users_autocast(fresh_autocast_warning):
    # engine="autocast" turns torch's autocast state on in the thread: that is hmp's, not a user's region
    hmp.convert(engine="autocast")
    assert torch.is_autocast_enabled("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hmp.convert(engine="autocast", cache=False)
        with hmp.converted(engine="python"):
            pass
    with torch.autocast("cpu", dtype=BF16), hmp.disable_casts():  # a user's region: still warned about
        with pytest.warns(UserWarning, match=r"inside an active torch.autocast region \(cpu\)"):
            hmp.convert(engine="autocast")


def test_autocast_warning_as_error_patches_nothing(fresh_autocast_warning, pristine):
    with torch.autocast("cpu", dtype=BF16):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(UserWarning):
                hmp.convert()
    assert not hmp.is_converted()
    assert_same(pristine, snapshot())


def test_what_the_autocast_warning_says_is_true(tmp_path, fresh_autocast_warning):
    # an op in hmp's FP32 list still runs in autocast's lower precision
    hmp.convert(fp32_file_path=write(tmp_path, "f.txt", "linear\n"))
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    assert F.linear(x.bfloat16(), w).dtype == FP32
    with torch.autocast("cpu", dtype=BF16):
        assert F.linear(x.bfloat16(), w).dtype == BF16
    # and one in hmp's BF16 list can run in fp32 (autocast's fp32 list has mse_loss)
    try:
        with hmp.disable_casts():
            F.mse_loss(x.bfloat16(), x.bfloat16())
    except RuntimeError as e:  # hmp would fall back to fp32 outside autocast too: nothing to show
        pytest.skip(f"torch {torch.__version__} has no bfloat16 CPU kernel for mse_loss ({e})")
    hmp.convert(bf16_file_path=write(tmp_path, "b.txt", "mse_loss\n"))
    assert F.mse_loss(x, x + 1).dtype == BF16
    with torch.autocast("cpu", dtype=BF16):
        assert F.mse_loss(x, x + 1).dtype == FP32


@pytest.mark.parametrize("value", ["yes", "True", "1", b"no"])
def test_isverbose_as_a_word_is_named_a_string_not_a_path(value):
    with pytest.raises(TypeError, match=r"isVerbose must be a bool \(True or False\), got the string") as e:
        hmp.convert(isVerbose=value)
    assert "path" not in str(e.value)
    assert not hmp.is_converted()


@pytest.mark.parametrize("value", ["fp16_ops.txt", "lists/fp16", b"/tmp/x"])
def test_isverbose_as_a_path_says_where_fp16_file_path_goes(value):
    with pytest.raises(TypeError, match="got the path .*pass fp16_file_path= by keyword"):
        hmp.convert(isVerbose=value)


@pytest.mark.parametrize("switch", ["disable_casts", "enable_casts"])
def test_a_switch_called_without_with_warns_at_the_callers_line(switch):
    import inspect
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        getattr(hmp, switch)()  # does nothing: the object is dropped at once
        with getattr(hmp, switch)():
            pass
        getattr(hmp, switch)()(lambda: None)()  # as a decorator
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)], [str(w.message) for w in caught]
    assert f"hmp.{switch}() was called but never entered" in str(caught[0].message)
    assert hmp.casts_enabled()


@needs_notes
def test_the_lower_list_is_named_by_the_dtype_it_runs_in():
    """The list files and parameters keep Habana's "bf16" names; a message names
    the lower list by the dtype in force, so float16 runs never read "BF16 list"."""
    mm = torch.mm  # a reference taken before convert(): its calls pass through nothing of hmp's
    for low, title in ((torch.bfloat16, "BF16"), (torch.float16, "FP16")):
        hmp.convert(low_precision_type=low)
        a, b = torch.randn(2, 2), torch.randn(2, 2).to(low)
        note = _unwrapped_note(lambda a=a, b=b: mm(a, b))
        assert f"'mm' is in the {title} list but this call was not cast" in note, note
        with hmp.disable_casts(), pytest.raises(RuntimeError) as info:
            torch.mm(a, b)
        assert notes(info.value)[0].startswith(f"hmp: torch.mm ({title} list) ran uncast"), notes(info.value)
        hmp.revert()


def test_convert_given_a_model_says_it_takes_none():
    with pytest.raises(TypeError, match=r"convert\(\) takes no model.*run Sequential as it is"):
        hmp.convert(torch.nn.Sequential())
    assert not hmp.is_converted()


def test_disable_and_enable_casts_decorate_without_parentheses():
    @hmp.disable_casts
    def off(x):
        return torch.mm(x, x).dtype, hmp.casts_enabled()

    @hmp.disable_casts
    def steps():
        yield hmp.casts_enabled()

    @hmp.enable_casts
    def on():
        return hmp.casts_enabled()

    x = torch.ones(2, 2)
    with hmp.converted():
        assert off(x) == (torch.float32, False) and list(steps()) == [False]
        assert torch.mm(x, x).dtype == torch.bfloat16  # the decorated call's block ended with it
        with hmp.disable_casts():
            assert on() is True and not hmp.casts_enabled()
    for switch in (hmp.disable_casts, hmp.enable_casts):
        with pytest.raises(TypeError, match=rf"hmp.{switch.__name__}\(\) takes no argument.*got 3"):
            switch(3)
