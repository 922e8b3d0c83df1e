"""core/ runs per call and calls nothing above it, seen at run time (issue 70): an import check
(tests/unit/test_structure.py) misses a call by duck typing or through a function handed down, so
this one traces one convert() and the calls a model makes and looks at every call's caller
(binding/ and driver/ are convert time; rules/ hand core the functions its switches run)."""

import os

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
