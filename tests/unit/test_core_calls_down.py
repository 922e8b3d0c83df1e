"""core/ runs per call and calls nothing above it, seen at run time (issue 70): an import check
(tests/unit/test_structure.py) misses a call by duck typing or through a function handed down, so
this one traces one convert() and the calls a model makes and looks at every call's caller
(binding/ and driver/ are convert time; rules/ hand core the functions its switches run), and at
which functions of core/ the convert() runs."""

import os
import types

import pytest
import torch
import torch.nn.functional as F
from helpers import profiled

import hmp

HMP = os.path.dirname(hmp.__file__) + os.sep
ABOVE = tuple(HMP + floor + os.sep for floor in ("binding", "driver"))
CORE = HMP + "core" + os.sep


def _calls_up(run):
    """``(caller, callee)`` for each call from a function in core/ to one on a floor above it."""
    found = set()

    def profile(frame, event, arg):
        if event == "call":
            caller = frame.f_back
            if caller is not None and caller.f_code.co_filename.startswith(CORE):
                name = frame.f_code.co_filename
                if name.startswith(ABOVE):
                    found.add((caller.f_code.co_qualname, f"{name[len(HMP) :]}:{frame.f_code.co_qualname}"))

    with profiled(profile):
        run()
    return found


def _model_calls():
    x = torch.randn(4, 8, requires_grad=True)
    w, b = torch.randn(16, 8, requires_grad=True), torch.randn(16, requires_grad=True)
    y = F.linear(x, w, bias=b)  # BF16 list, a keyword
    y = F.layer_norm(y, (16,))  # FP32 list
    y = torch.cat([y, y.float()], 1)  # promote list
    y = F.softmax(y, -1) @ torch.randn(32, 4)  # an operator
    y.float().sum().backward()
    with torch.no_grad():
        F.linear(x, w)
    with hmp.disable_casts():
        F.linear(x, w)


def test_convert_and_calls_never_call_up_from_core(pristine):
    ups = _calls_up(lambda: (hmp.convert(), _model_calls(), hmp.revert()))
    assert not ups, sorted(ups)


# core/ modules read whenever hmp reads what they hold, at convert time too: torch's private names and
# what each release has are kept there by rule (tests/unit/test_structure.py), wherever they are read
_READ_ANY_TIME = ("torch_private.py", "torch_releases.py")
# convert-time functions core/ keeps, each with why it is not a binding/ function
_SHARED = {
    "identity.py:unwrap": "reads a wrapper's mark: at convert time, and in calls that meet a wrapper",
    "cast_copies.py:overflow_limit": "the BF16 rule's bound on numbers, read as it builds the per-call check",
    # a release that lacks something (2.4.1, 2.11) says so at convert(); a region in a call says its own once
    "state.py:first_time": "what is said once per process: at convert time, and in calls (rules/regions.py)",
    # per thread too, where no hook sees it: a thread started while converted joins before its profile
    # hook is set (test_engine.py::test_threads_started_while_converted_join_and_earlier_ones_do_not)
    "delegation.py:Engine.join": "the converting thread joins the engine; so does each thread it starts",
    # core imports nothing above it, so the driver hands it diagnostics' note at install
    "rescue.py:on_error": "the wrappers' error path keeps its annotators beside it",
}


def _codes(value, depth=0):
    """The code objects of what a function returned: a function, a partial, or a tuple, list or dict of them."""
    code = getattr(value, "__code__", None)
    if code is not None:
        yield code
    if depth < 2:
        inner = [getattr(value, "func", None)] + list(
            value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
        )
        for v in inner:
            yield from _codes(v, depth + 1)


def _core_runs(run):
    """``(ran, made)``: the code objects of core/ that ran, and for each the core/ code it returned."""
    ran, made = set(), {}

    def profile(frame, event, arg):
        code = frame.f_code
        if code.co_filename.startswith(CORE):
            if event == "call":
                ran.add(code)
            elif event == "return":
                made.setdefault(code, set()).update(c for c in _codes(arg) if c.co_filename.startswith(CORE))

    with profiled(profile):
        run()
    return ran, made


def _nested(code):
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield c
            yield from _nested(c)


def _program():
    _model_calls()
    hmp.clear_cache()  # a program's call of core's own API


@pytest.mark.parametrize("engine", ["python", "autocast"])
def test_what_core_runs_in_convert_runs_per_call(pristine, engine):
    """Every function of core/ that a convert() runs also runs in the converted program's calls, or
    makes per-call code (returns a function of core/, or is defined inside one that does): deciding,
    probing and installing are binding/'s and driver/'s. The second convert() of a process: a
    first one also fills what is kept once per process."""
    hmp.convert(engine=engine)
    hmp.revert()
    try:
        converting, made = _core_runs(lambda: hmp.convert(engine=engine))
        calls, _ = _core_runs(_program)
    finally:
        hmp.revert()
    builders = {c for c in converting if made.get(c)}
    built_inside = {n for b in builders for n in _nested(b)}
    left = sorted(
        f"{c.co_filename[len(CORE) :]}:{c.co_qualname}"
        for c in converting - calls - builders - built_inside
        if not c.co_filename.endswith(_READ_ANY_TIME)
    )
    assert [name for name in left if name.partition(".<locals>")[0] not in _SHARED] == [], left
