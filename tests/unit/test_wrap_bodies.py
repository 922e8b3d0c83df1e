"""The wrapper body's two implementations do the same thing, call for call.

hmp/core/wrap.py's Python closure is the oracle: for each C wrapper
(hmp.core._wrap, wrapping a C function) the Python body is built from that
wrapper's own fields (``wrap._traced``, which is also what torch.compile traces
in its place). Hypothesis draws calls of listed C functions (positional and
keyword arguments, every floating dtype, values and numbers a lower dtype
cannot hold, decay factors, lists of tensors, ``out=``, in-place methods),
and both bodies must give the same result, dtypes, gradients, caller's
tensors afterwards and exception. The rest: which body a wrapper gets, binding
as a method, pickling, references, and the Python body when the C one is off.
"""

import copy
import gc
import inspect
import os
import pickle
import subprocess
import sys
import tracemalloc
import weakref

import pytest
import torch
import torch.nn.functional as F
from helpers import c_body_expected, has_c_compiler
from hypothesis import given
from hypothesis import strategies as st

import hmp
from hmp.core import state, wrap
from hmp.core.resolve import unwrap

C_BODY = pytest.mark.skipif(
    wrap.BODY != "C", reason="the C body is not in use here (not built, HMP_PURE_PYTHON, or torch < 2.5)"
)
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# values a cast must keep finite (bfloat16's and float16's largest, float32's extremes) and others it must keep
SPECIAL = (float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38, 70000.0, -65504.0, 0.0, -0.0)


def _tensor(draw, shape, grad=False):
    dtype = draw(st.sampled_from(FLOATS))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    t = torch.randn(shape, generator=g) * draw(st.sampled_from((1.0, 1e3, 1e30)))
    for _ in range(draw(st.integers(0, 2))):
        t.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(st.sampled_from(SPECIAL))
    t = t.to(dtype)
    if grad and draw(st.booleans()):
        t.requires_grad_(True)
    return t


NUMBERS = st.sampled_from((2.0, 0.5, 0.995, 1.0, 1, 3, 3.4e38, -3.4e38, torch.finfo(torch.float32).min, float("inf")))


@st.composite
def calls(draw):
    """(site name, the function, args, kwargs): a call of a listed C function."""
    shape = (3, 3)
    a, b = _tensor(draw, shape, grad=True), _tensor(draw, shape, grad=True)
    kind = draw(st.integers(0, 11))
    if kind == 0:
        return "F.linear", F.linear, (a, b, _tensor(draw, (3,), grad=True)), {}
    if kind == 1:
        return "torch.mm", torch.mm, (a, b), {}
    if kind == 2:
        return "torch.matmul", torch.matmul, (), {"input": a, "other": b}
    if kind == 3:  # the promote rule, positional and in a list
        return "torch.cat", torch.cat, ([a, b, _tensor(draw, shape)],), draw(st.sampled_from(({}, {"dim": 1})))
    if kind == 4:
        return "torch.add", torch.add, (a, b), draw(st.sampled_from(({}, {"alpha": 2})))
    if kind == 5:  # a multiplication: decay factors and numbers the lower dtype cannot hold
        return "torch.mul", torch.mul, (a, draw(NUMBERS)), {}
    if kind == 6:
        return "torch.mul", torch.mul, (draw(NUMBERS), a), {}
    if kind == 7:  # the FP32 list
        return "torch.softmax", torch.softmax, (a, -1), {}
    if kind == 8:  # out=: the written tensor is the caller's
        out = torch.empty(shape, dtype=draw(st.sampled_from(FLOATS)))
        return "torch.mm", torch.mm, (a.detach(), b.detach()), {"out": out}
    if kind == 9:  # a method: what x.mm(y) calls
        return "Tensor.mm", torch.Tensor.mm, (a, b), {}
    if kind == 10:  # an in-place method writes its first argument
        return "Tensor.add_", torch.Tensor.add_, (a.detach().clone(), b.detach()), {}
    return "torch.addmm", torch.addmm, (_tensor(draw, shape), a, b), {"beta": draw(st.sampled_from((1, 0.5)))}


def _clone(v):
    if isinstance(v, torch.Tensor):
        c = v.detach().clone()
        return c.requires_grad_(v.requires_grad)
    if isinstance(v, (list, tuple)):
        return type(v)(_clone(x) for x in v)
    if isinstance(v, dict):
        return {k: _clone(x) for k, x in v.items()}
    return v


def _leaves(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _leaves(x)]
    if isinstance(v, dict):
        return [t for x in v.values() for t in _leaves(x)]
    return []


def _run(fn, args, kwargs):
    """What a call leaves behind: the result or the error, the arguments
    afterwards and the gradients of the ones that require grad."""
    try:
        result = fn(*args, **kwargs)
    except Exception as e:  # both bodies must raise the same
        return ("raised", type(e), str(e).splitlines()[0]), _leaves((args, kwargs)), []
    grads = []
    if isinstance(result, torch.Tensor) and result.requires_grad:
        result.float().nan_to_num(0.0, 1.0, -1.0).sum().backward()
        grads = [t.grad for t in _leaves((args, kwargs)) if t.requires_grad]
    return result, _leaves((args, kwargs)), grads


def _same(p, c):
    if isinstance(p, tuple) and p and p[0] == "raised":
        return p == c
    if isinstance(p, torch.Tensor):
        return (
            isinstance(c, torch.Tensor)
            and p.dtype == c.dtype
            and p.shape == c.shape
            and torch.equal(p.detach().nan_to_num(7.0), c.detach().nan_to_num(7.0))
            and torch.equal(p.detach().isnan(), c.detach().isnan())
        )
    if isinstance(p, list):
        return isinstance(c, list) and len(p) == len(c) and all(_same(x, y) for x, y in zip(p, c))
    return p is None and c is None


@C_BODY
@given(call=calls())
def test_the_c_body_does_what_the_python_body_does(call):
    name, _, args, kwargs = call
    hmp.convert()
    owner, attr = name.split(".")
    site = getattr({"F": F, "torch": torch, "Tensor": torch.Tensor}[owner], attr)
    assert type(site) is wrap._CWrapper, name
    c_args, c_kwargs = _clone(args), _clone(kwargs)
    c = _run(site, c_args, c_kwargs)
    py = _run(lambda *a, **k: wrap._traced(site, *a, **k), args, kwargs)
    assert state.tls.off == 0 and not state.tls.fresh
    assert _same(py[0], c[0]), (name, py[0], c[0])
    assert _same(py[1], c[1]), (name, "the arguments afterwards differ")
    assert _same(py[2], c[2]), (name, "the gradients differ")


def test_a_wrapper_is_the_kind_of_callable_its_original_is():
    hmp.convert()
    assert inspect.isfunction(F.relu) and wrap.is_wrapper(F.relu)  # a Python function: the Python body
    for site in (F.linear, torch.mm, torch.Tensor.mm, torch.cat):
        assert wrap.is_wrapper(site)
        assert (type(site) is wrap._CWrapper) == (wrap.BODY == "C")
        assert site.__wrapped__ is not None and site.__name__ in ("linear", "mm", "cat")
    hmp.revert()
    assert type(F.linear) is type(torch.mm) and not wrap.is_wrapper(F.linear)


@C_BODY
def test_a_c_wrapper_binds_as_a_method_and_reads_as_its_original():
    hmp.convert()
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    assert a.mm(b).dtype == torch.bfloat16 and torch.Tensor.mm(a, b).dtype == torch.bfloat16
    assert (a @ b).dtype == torch.bfloat16  # matmul is listed: __matmul__ calls it
    bound = a.mm
    assert bound.__self__ is a and bound(b).dtype == torch.bfloat16
    assert repr(torch.mm) == f"<hmp wrapper {torch.mm.__qualname__}>"
    assert inspect.unwrap(F.linear) is unwrap(F.linear)
    with hmp.disable_casts():
        assert a.mm(b).dtype == torch.float32


@C_BODY
def test_a_c_wrapper_pickles_and_copies_as_a_function_does():
    hmp.convert()
    assert pickle.loads(pickle.dumps(torch.mm)) is torch.mm
    assert copy.deepcopy(F.linear) is F.linear and copy.copy(F.linear) is F.linear
    kept = torch.mm
    hmp.revert()  # kept is retired: its name now finds torch's own mm
    with pytest.raises(pickle.PicklingError, match="retired by revert"):
        pickle.dumps(kept)
    assert kept(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32


def _repeat(path, n):
    for _ in range(n):
        try:
            path(torch.randn(4, 4))
        except RuntimeError:
            pass
    gc.collect()


@C_BODY
def test_the_c_body_keeps_no_reference_to_what_a_call_was_given():
    """Every path (cast, nothing to cast, keywords, a number that sends the
    call to the FP32 rule, the promote rule, an op that raises) drops its
    arguments and grows no memory over thousands of calls."""
    hmp.convert()
    w = torch.nn.Parameter(torch.randn(4, 4))
    paths = [
        lambda x: F.linear(x, w),
        lambda x: torch.softmax(x, -1),
        lambda x: torch.add(x, x, alpha=2),
        lambda x: torch.mul(x, 3.4e38),
        lambda x: torch.cat([x, x.double()]),
        lambda x: torch.mm(x, torch.randn(3, 3)),  # raises: shapes
    ]
    for path in paths:
        x = torch.randn(4, 4)
        ref = weakref.ref(x)
        try:
            path(x)
        except RuntimeError:
            pass
        del x
        gc.collect()
        assert ref() is None, "an argument outlived its call"
        tracemalloc.start()
        _repeat(path, 200)
        before = tracemalloc.get_traced_memory()[0]
        _repeat(path, 5000)
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert grown < 64 * 1024, f"{grown} bytes more after 5000 calls"


@C_BODY
def test_an_error_from_a_c_op_gets_hmps_note_and_no_wrapper_frame():
    hmp.convert()
    with pytest.raises(RuntimeError) as info:
        torch.mm(torch.randn(2, 3), torch.randn(2, 3))
    frames = [f.name for f in info.traceback]
    assert "wrapper" not in frames  # the C body adds no frame of its own
    assert state.tls.off == 0


def test_the_c_body_runs_where_it_can():
    """Where a compiler built it and torch can trace its Python body in its
    place, the C body is the one in use: a failed build is not silent."""
    if not has_c_compiler() or os.environ.get("HMP_PURE_PYTHON", "") not in ("", "0"):
        pytest.skip("no C compiler here, or HMP_PURE_PYTHON is set")
    assert wrap.BODY == c_body_expected(built=True)


def test_hmp_pure_python_runs_the_python_body(tmp_path):
    code = (
        "import torch, torch.nn.functional as F, hmp\n"
        "from hmp.core import wrap\n"
        "hmp.convert()\n"
        "x = torch.randn(3, 4, requires_grad=True)\n"
        "w = torch.nn.Parameter(torch.randn(5, 4))\n"
        "y = F.linear(x, w)\n"
        "y.float().sum().backward()\n"
        "print(wrap.BODY, type(F.linear).__name__, y.dtype, w.grad.dtype, torch.mul(x, 3.4e38).dtype)\n"
    )
    env = dict(os.environ, HMP_PURE_PYTHON="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["Python", "function", "torch.bfloat16", "torch.float32", "torch.float32"]
