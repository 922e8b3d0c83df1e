"""The promote list follows torch's type promotion for what counts: 0-dim
tensors and Python scalars do not widen dimensioned tensors.

The oracle is ``torch.result_type`` folded over the arguments (an
intermediate keeps "dimensioned" when either side had dimensions, which is
how torch ranks them), not hmp's code.
"""

import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hmp
from hmp.binding import list_files

FLOATING = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
N = 4


def t(spec):
    dtype, zero_dim = spec
    return torch.randn(() if zero_dim else (N,)).to(dtype)


def oracle(values):
    """torch.result_type over any number of arguments."""
    acc = None
    for v in values:
        if acc is None:
            acc = v if isinstance(v, torch.Tensor) else None
            continue
        dim = acc.dim() or (isinstance(v, torch.Tensor) and v.dim())
        acc = torch.empty((1,) if dim else (), dtype=torch.result_type(acc, v))
    return acc.dtype


def _binary(fn):
    if isinstance(fn, str):  # looked up at call time: the converted name
        name = fn
        fn = lambda a, b: getattr(torch, name)(a, b)  # noqa: E731
    return lambda s: ((t(s[0]), t(s[1])), fn)


def _index(fn):
    # self is dimensioned; the source follows its drawn dtype, 0-dim where the op allows
    return lambda s: ((t((s[0][0], False)), t((s[1][0], False))), fn)


idx = torch.tensor([0, 2])
mask = torch.tensor([True, False, True, False])
BUILD = {
    "add": _binary("add"),
    "sub": _binary("sub"),
    "subtract": _binary("subtract"),
    "rsub": _binary("rsub"),
    "mul": _binary("mul"),
    "multiply": _binary("multiply"),
    "div": _binary("div"),
    "truediv": _binary(lambda a, b: a / b),
    "pow": _binary("pow"),
    "atan2": _binary("atan2"),
    "maximum": _binary("maximum"),
    "minimum": _binary("minimum"),
    "fmax": _binary("fmax"),
    "fmin": _binary("fmin"),
    "hypot": _binary("hypot"),
    "addcmul": lambda s: ((t(s[0]), t(s[1]), t(s[2])), lambda a, b, c: torch.addcmul(a, b, c)),
    "addcdiv": lambda s: ((t(s[0]), t(s[1]), t(s[2]).abs() + 1), lambda a, b, c: torch.addcdiv(a, b, c)),
    "lerp": lambda s: ((t((s[0][0], False)), t(s[1]), t(s[2])), lambda a, b, c: torch.lerp(a, b, c)),
    "where": lambda s: ((t(s[0]), t(s[1])), lambda a, b: torch.where(mask, a, b)),
    "cat": _index(lambda a, b: torch.cat([a, b])),
    "concat": _index(lambda a, b: torch.concat([a, b])),
    "concatenate": _index(lambda a, b: torch.concatenate([a, b])),
    "stack": _index(lambda a, b: torch.stack([a, b])),
    "hstack": _index(lambda a, b: torch.hstack([a, b])),
    "vstack": _index(lambda a, b: torch.vstack([a, b])),
    "dstack": _index(lambda a, b: torch.dstack([a, b])),
    "index_put": lambda s: (
        (t((s[0][0], False)), t(s[1])[:2] if not s[1][1] else t(s[1])),
        lambda x, v: torch.index_put(x, (idx,), v),
    ),
    "index_add": lambda s: ((t((s[0][0], False)), t((s[1][0], False))[:2]), lambda x, v: torch.index_add(x, 0, idx, v)),
    "index_copy": lambda s: (
        (t((s[0][0], False)), t((s[1][0], False))[:2]),
        lambda x, v: torch.index_copy(x, 0, idx, v),
    ),
    "scatter": lambda s: ((t((s[0][0], False)), t((s[1][0], False))), lambda x, v: torch.scatter(x, 0, idx, v)),
    "scatter_add": lambda s: ((t((s[0][0], False)), t((s[1][0], False))), lambda x, v: torch.scatter_add(x, 0, idx, v)),
    "masked_scatter": lambda s: ((t((s[0][0], False)), t((s[1][0], False))), lambda x, v: x.masked_scatter(mask, v)),
}
PROMOTE = list_files.names(list_files.default_path("promote.txt"))
_DIR = Path(tempfile.mkdtemp(prefix="hmp-promote-"))
(_DIR / "empty.txt").write_text("# nothing\n")


def test_every_promote_op_has_a_builder():
    assert sorted(BUILD) == sorted(PROMOTE)


specs = st.tuples(st.sampled_from(FLOATING), st.booleans())


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op=st.sampled_from(sorted(BUILD)), s=st.tuples(specs, specs, specs), scalar=st.booleans())
def test_promote_list_follows_result_type(op, s, scalar):
    """Promote list alone (BF16 and FP32 lists empty): every op's result has
    the dtype torch.result_type gives its tensor arguments."""
    args, fn = BUILD[op](s)
    if scalar and op in ("add", "sub", "mul", "div", "pow", "rsub"):
        args = (args[0], 0.5)  # a Python scalar never widens
    expected = oracle(args)
    hmp.convert(bf16_file_path=_DIR / "empty.txt", fp32_file_path=_DIR / "empty.txt")
    try:
        got = fn(*args)
    finally:
        hmp.revert()
    assert got.dtype == expected, f"{op}{tuple(getattr(a, 'dtype', a) for a in args)}"


def test_zero_dim_float64_does_not_widen_then_linear_runs():
    """The issue's case: x + torch.tensor(0.5, dtype=float64) stays float32
    (as in torch), so the next nn.Linear runs in bf16 instead of crashing."""
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    hmp.convert()
    y = x + torch.tensor(0.5, dtype=torch.float64)
    assert y.dtype == torch.float32
    assert lin(y).dtype == torch.bfloat16


@pytest.mark.parametrize("op", ["add", "sub", "maximum", "where"])
def test_bf16_with_zero_dim_fp32_stays_bf16(op):
    """bf16 + torch.tensor(1.0) is bf16 in torch; so it is under hmp."""
    x, s = torch.randn(3).bfloat16(), torch.tensor(1.0)
    call = (lambda: torch.where(x > 0, x, s)) if op == "where" else (lambda: getattr(torch, op)(x, s))
    hmp.convert(bf16_file_path=_DIR / "empty.txt", fp32_file_path=_DIR / "empty.txt")
    assert call().dtype == torch.bfloat16
    assert torch.cat([x, torch.randn(2)]).dtype == torch.float32  # both dimensioned: widened, as before
