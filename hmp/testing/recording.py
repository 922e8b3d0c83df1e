"""What each op ran in: recorded where torch's functions see their arguments
(a TorchFunctionMode: after hmp's casts, the call torch itself receives),
never by asking hmp.

The mode sees each call of a torch function (``torch.mm``, ``F.linear``,
``x @ w``, a Tensor method) that the code makes, the outermost one: the ops
inside a torch function of its own (the products inside
``F.multi_head_attention_forward``) are that function's. The casts hmp makes
(its copies of the arguments) are not recorded as ops.
"""

import os
import sys
from typing import NamedTuple, Optional

import torch
from torch.overrides import TorchFunctionMode

from hmp.core import cache, cast_copies, dtypes, policy
from hmp.core.dtypes import FLOATS as _FLOATING
from hmp.core.dtypes import first_floating
from hmp.testing import entries

_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_HERE = os.path.dirname(os.path.abspath(__file__))
# the modules whose torch calls are hmp's casts, not the program's ops
_CASTING = frozenset(os.path.abspath(m.__file__) for m in (cast_copies, cache, policy))
_IGNORED = frozenset(("__get__", "__set__"))  # a tensor's attributes (x.dtype), read through the mode too


class Ran(NamedTuple):
    """One call of a torch function, as torch received it."""

    name: str  # the list name it is known by: matmul for x @ w, add for add_
    function: str  # the function torch saw: __matmul__, add_, linear
    inputs: tuple  # the floating dtypes of the tensors it received, in argument order
    dtype: Optional[torch.dtype]  # its floating result's (the first floating tensor it returned), or None
    received: tuple  # the tensors it received, in argument order

    def matches(self, key):
        return key in (self.name, self.function)

    def __str__(self):
        inputs = ", ".join(dtypes.name(d) for d in self.inputs)
        result = dtypes.name(self.dtype) if self.dtype is not None else "no floating result"
        return f"{self.function}({inputs}) -> {result}"


def _flat(values):
    for v in values:
        if type(v) is list or type(v) is tuple:
            yield from _flat(v)
        else:
            yield v


def _made_by_a_cast():
    """True when the first frame outside torch and this package is one of
    hmp's casting modules."""
    frame = sys._getframe(2)
    while frame is not None:
        where = frame.f_code.co_filename
        if not (where.startswith(_TORCH) or where.startswith(_HERE)):
            return os.path.abspath(where) in _CASTING
        frame = frame.f_back
    return False


class record_ops(TorchFunctionMode):
    """``with record_ops() as ran:``: ``ran`` is the list of Ran, one per
    torch function call the block makes (the outermost; hmp's own casts left
    out), in order."""

    def __init__(self):
        super().__init__()
        self.ran = []

    def __enter__(self):
        super().__enter__()
        return self.ran

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", "") or ""
        if name in _IGNORED or _made_by_a_cast():
            return result
        received = tuple(t for t in _flat((*args, *kwargs.values())) if isinstance(t, torch.Tensor))
        inputs = tuple(t.dtype for t in received if t.dtype in _FLOATING)
        self.ran.append(Ran(entries.list_name(func), name, inputs, first_floating(result), received))
        return result


def assert_runs_as(fn, /, *args, expect, **kwargs):
    """Call ``fn(*args, **kwargs)`` and check that every op named in
    ``expect`` ({list name or function name: dtype}, ``{"mm": torch.bfloat16}``)
    ran, and every call of it returned its floating result in that dtype.
    Raises AssertionError naming each op that did not, with what it ran in;
    returns ``fn``'s result. A name matches the list name a call is known by
    (``matmul`` for ``a @ b``, ``add`` for ``add_``) or the function torch saw
    (``__matmul__``, ``add_``)."""
    if not isinstance(expect, dict) or not expect:
        raise TypeError(f"expect must be a non-empty dict of op name -> dtype, got {expect!r}")
    with record_ops() as ran:
        result = fn(*args, **kwargs)
    problems = []
    for key, dtype in expect.items():
        calls = [r for r in ran if r.matches(key)]
        if not calls:
            seen = ", ".join(dict.fromkeys(r.name for r in ran)) or "none"
            problems.append(f"{key} never ran (ops that ran: {seen})")
            continue
        wrong = [r for r in calls if r.dtype != dtype]
        if wrong:
            shown = "; ".join(str(r) for r in wrong[:3]) + (f"; and {len(wrong) - 3} more" if len(wrong) > 3 else "")
            said = f"{len(wrong)} of {len(calls)} calls were not"
            problems.append(f"{key}: expected {dtypes.name(dtype)}, {said}: {shown}")
    if problems:
        raise AssertionError("hmp: ops did not run as expected:\n  " + "\n  ".join(problems))
    return result
