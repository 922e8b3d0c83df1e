"""What each op ran in: recorded where torch's functions see their arguments
(a TorchFunctionMode: after hmp's casts, the call torch itself receives),
never by asking hmp.

The mode sees each call of a torch function (``torch.mm``, ``F.linear``,
``x @ w``, a Tensor method) that the code makes, the outermost one: the ops
inside a torch function of its own (the products inside
``F.multi_head_attention_forward``) are that function's. A torch function
written in Python (``F.pad``, ``F.multi_head_attention_forward``) sees its
arguments before its body runs, and a conversion may take effect at a call
its body makes (hmp casts ``F.pad``'s input at ``torch._C._nn.pad``): its Ran
also holds, as ``inner``, the calls its body made (one level: each recorded
as the outermost is, the ops inside them theirs). The casts hmp makes (its
copies of the arguments) are not recorded as ops.
"""

import os
import sys
from types import FunctionType
from typing import NamedTuple, Optional

import torch
from torch.overrides import TorchFunctionMode

from hmp.binding.picked import flat
from hmp.core import cache, cast_copies, dtypes, policy
from hmp.core.dtypes import FLOATS as _FLOATING
from hmp.core.dtypes import first_floating
from hmp.testing import entries

_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_HERE = os.path.dirname(os.path.abspath(__file__))
# runs a torch function's body with the mode on for the calls it makes (torch >= 2.12; None before: bodies unseen)
_REDISPATCH = getattr(torch.overrides, "redispatch_function", None)
SEES_BODIES = _REDISPATCH is not None
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
    fn: object = None  # the function torch saw (the callable)
    args: tuple = ()  # the arguments it received
    kwargs: Optional[dict] = None
    inner: tuple = ()  # a torch function written in Python: the Ran of each call its body made, in order

    def matches(self, key):
        return key in (self.name, self.function)

    def __str__(self):
        inputs = ", ".join(dtypes.name(d) for d in self.inputs)
        result = dtypes.name(self.dtype) if self.dtype is not None else "no floating result"
        return f"{self.function}({inputs}) -> {result}"


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


def _opens(func, types, name):
    """True for a call whose body is recorded: a torch function written in
    Python, given no tensor subclass of its own ``__torch_function__`` (whose
    handler must see the call: the body is left to it)."""
    plain = all(t is torch.Tensor or t is torch.nn.Parameter for t in types)
    return SEES_BODIES and plain and isinstance(func, FunctionType) and name not in _IGNORED


class record_ops(TorchFunctionMode):
    """``with record_ops() as ran:``: ``ran`` is the list of Ran, one per
    torch function call the block makes (the outermost; hmp's own casts left
    out), in order; a torch function written in Python holds the calls its
    body made in its ``inner``."""

    def __init__(self):
        super().__init__()
        self.ran = []
        self._body = None  # while a Python torch function's body runs: the list its calls go to

    def __enter__(self):
        super().__enter__()
        return self.ran

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "") or ""
        into, inner = (self.ran if self._body is None else self._body), []
        if self._body is None and _opens(func, types, name):
            self._body = inner  # the mode back on for the calls its body makes, that call's own dispatch skipped
            try:
                with self:
                    result = _REDISPATCH(func, types, args, kwargs)
            finally:
                self._body = None
        else:
            result = func(*args, **kwargs)
        if name in _IGNORED or _made_by_a_cast():
            return result
        received = tuple(t for t in flat((*args, *kwargs.values())) if isinstance(t, torch.Tensor))
        inputs = tuple(t.dtype for t in received if t.dtype in _FLOATING)
        ran = Ran(entries.list_name(func), name, inputs, first_floating(result), received)
        into.append(ran._replace(fn=func, args=tuple(args), kwargs=kwargs, inner=tuple(inner)))
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
