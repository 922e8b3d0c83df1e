"""core/ runs per call and calls nothing above it, seen at run time (issue 70): an import check
(tests/unit/test_structure.py) misses a call by duck typing or through a function handed down, so
this one traces one convert() and the calls a model makes and looks at every call's caller
(binding/ and driver/ are convert time; rules/ hand core the functions its switches run), at
which functions of core/ the convert() runs, and (issue 80) that a converted call runs no frame
of binding/ or driver/ at all: the per-call halves live in core/."""

import copy
import os
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import profiled

import hmp

HMP = os.path.dirname(hmp.__file__) + os.sep
ABOVE = tuple(HMP + floor + os.sep for floor in ("binding", "driver"))
CORE = HMP + "core" + os.sep


# decisions binding/ makes at a call, once: core/ keeps each answer and never asks again for the same op
# or key (test_a_converted_call_runs_no_frame_above_core checks the second call)
_DECIDED_AT_FIRST_CALL = {
    "binding/modules.py:op_rules.<locals>.decide": "an op's rule inside a BF16 module: it reads torch's schemas",
    "binding/picked.py:chooser.<locals>.decided": "a picked op's call, traced once per key on meta tensors",
}


def _calls_up(run):
    """``(caller, callee)`` for each call from a function in core/ to one on a floor above it."""
    found = set()

    def profile(frame, event, arg):
        if event == "call":
            caller = frame.f_back
            if caller is not None and caller.f_code.co_filename.startswith(CORE):
                name = frame.f_code.co_filename
                callee = f"{name[len(HMP) :]}:{frame.f_code.co_qualname}"
                if name.startswith(ABOVE) and callee not in _DECIDED_AT_FIRST_CALL:
                    found.add((caller.f_code.co_qualname, callee))

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


class _InLower(nn.Module):
    """A BF16 module entry: its linear through the listed wrapper, its other ops through the mode."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.linear(x)) + x.exp()


class _InFloat32(nn.Module):
    """An FP32 module entry."""

    def forward(self, x):
        return x.softmax(-1)


@hmp.bf16_function
def _users_function(x, w):
    return x @ w


_habana_wrapped = hmp.op_wrap(torch.add, lambda t: t.float())


def _entry_calls(lower, upper):
    """Module entries (and a copy of one), ops whose argument picks their kernel, a user function,
    Habana's op_wrap."""
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    y = upper(copy.deepcopy(lower)(x) + lower(x))
    image = torch.randn(1, 2, 6, 6)
    F.pad(image, (1, 1, 1, 1), mode="reflect")  # picks reflection_pad2d: the FP32 list
    F.pad(image, (1, 1), mode="constant")  # picks constant_pad_nd: no list
    y = torch.einsum("ij,jk->ik", y, w)
    y = _users_function(y, w) + _habana_wrapped(y, y)
    y.float().sum().backward()


def _converted(engine):
    lower, upper = _InLower(), _InFloat32()
    hmp.convert(engine=engine, bf16_modules=[lower], fp32_modules=[_InFloat32])
    return lambda: (_model_calls(), _entry_calls(lower, upper))


def test_convert_and_calls_never_call_up_from_core(pristine):
    ups = _calls_up(lambda: (_converted("python")(), hmp.revert()))
    assert not ups, sorted(ups)


@pytest.mark.parametrize("engine", ["python", "autocast"])
def test_a_converted_call_runs_no_frame_above_core(pristine, engine):
    """The convert-time / call-time line where docs/architecture.md draws it: a converted program's
    calls (listed ops, keywords, regions, module entries, picked ops, user functions, op_wrap,
    backward) run no function of binding/ or driver/ once each op and key has been met."""
    calls = _converted(engine)
    try:
        calls()  # the first call of an op or key: binding/ decides, once (_DECIDED_AT_FIRST_CALL)
        above = set()

        def profile(frame, event, arg):
            name = frame.f_code.co_filename
            if event == "call" and name.startswith(ABOVE):
                above.add(f"{name[len(HMP) :]}:{frame.f_code.co_qualname}")

        with profiled(profile):
            calls()
    finally:
        hmp.revert()
    assert not above, sorted(above)


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


def _constructors(converting, calls):
    """The ``__init__`` of core/ that made an object whose methods the program's calls run (the
    mode a BF16 module pushes): per-call code made at convert time, as a returned function is."""
    ran = {c.co_qualname for c in calls}
    return {
        c
        for c in converting
        if c.co_name == "__init__" and any(q.startswith(c.co_qualname[: -len("__init__")]) for q in ran)
    }


@pytest.mark.parametrize("engine", ["python", "autocast"])
def test_what_core_runs_in_convert_runs_per_call(pristine, engine):
    """Every function of core/ that a convert() runs also runs in the converted program's calls, or
    makes per-call code (returns a function of core/, is defined inside one that does, or builds an
    object whose methods the calls run): deciding,
    probing and installing are binding/'s and driver/'s. The second convert() of a process: a
    first one also fills what is kept once per process."""
    _converted(engine)
    hmp.revert()
    try:
        program = []
        converting, made = _core_runs(lambda: program.append(_converted(engine)))
        calls, _ = _core_runs(lambda: (program[0](), hmp.clear_cache()))  # clear_cache: core's own API
    finally:
        hmp.revert()
    builders = {c for c in converting if made.get(c)} | _constructors(converting, calls)
    built_inside = {n for b in builders for n in _nested(b)}
    left = sorted(
        f"{c.co_filename[len(CORE) :]}:{c.co_qualname}"
        for c in converting - calls - builders - built_inside
        if not c.co_filename.endswith(_READ_ANY_TIME)
    )
    assert [name for name in left if name.partition(".<locals>")[0] not in _SHARED] == [], left
