"""Property-based tests of the cast rules on drawn list assignments, call forms, dtypes and
disable_casts() nesting, against hmp.testing's oracle (``expected_call``: the rules as documented,
computed without hmp's wrapper), the one the kit gives users.

What the op really received is recorded by hmp.testing.record_ops, a TorchFunctionMode that sees
the call hmp's wrapper makes to the original op, after any casts.
"""

import contextlib
import operator
import tempfile
from pathlib import Path

import torch
from helpers import DEVICES
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import hmp
from hmp.testing import expected_call, record_ops

FP16, BF16, FP32, FP64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
FLOATING = [FP16, BF16, FP32, FP64]
ALL_DTYPES = FLOATING + [torch.int32, torch.int64, torch.bool, torch.complex64]


# -- list files for a drawn category assignment ------------------------------------

_DIR = Path(tempfile.mkdtemp(prefix="hmp-rules-"))
OPS = ["add", "mul", "cat"]


def convert_with(assign, low):
    files = {}
    for kind in ("bf16", "fp32", "promote"):
        names = sorted(op for op, c in assign.items() if c == kind)
        path = _DIR / f"{kind}-{'-'.join(names) or 'none'}.txt"
        path.write_text("# drawn by hypothesis\n" + "\n".join(names) + "\n")
        files[kind] = path
    # an empty user list file is a valid, empty list
    hmp.convert(
        bf16_file_path=files["bf16"],
        fp32_file_path=files["fp32"],
        promote_file_path=files["promote"],
        low_precision_type=low,
    )


def make(dtype, device, shape=(3,)):
    if dtype == torch.bool:
        return torch.rand(shape, device=device) > 0.5
    if dtype in (torch.int32, torch.int64):
        return torch.randint(-5, 5, shape, device=device, dtype=dtype)
    if dtype == torch.complex64:
        return torch.randn(shape, device=device, dtype=dtype)
    return torch.randn(shape, device=device).to(dtype)


def call(op, form, tensors, out=None):
    """``(function, args, kwargs)`` of ``op`` in ``form``."""
    a, b = tensors[0], tensors[1]
    if op == "cat":
        return {
            "function": (torch.cat, (list(tensors),), {}),
            "keyword": (torch.cat, (), {"tensors": list(tensors)}),
            "tuple": (torch.cat, (tuple(tensors),), {}),
            "out": (torch.cat, (list(tensors),), {"out": out}),
        }[form]
    return {
        "function": (getattr(torch, op), (a, b), {}),
        "keyword": (getattr(torch, op), (), {"input": a, "other": b}),
        "method": (getattr(a, op), (b,), {}),
        "operator": (getattr(operator, op), (a, b), {}),
        "inplace": (getattr(a, op + "_"), (b,), {}),
        "ioperator": (getattr(operator, "i" + op), (a, b), {}),
        "out": (getattr(torch, op), (a, b), {"out": out}),
    }[form]


def _cast_as(tensors, dtypes):
    """``tensors`` with the floating ones, in order, in ``dtypes``."""
    it = iter(dtypes)
    return [t.to(next(it)) if t.dtype in FLOATING else t.clone() for t in tensors]


FORMS = {
    "add": ["function", "keyword", "method", "operator", "inplace", "ioperator", "out"],
    "mul": ["function", "keyword", "method", "operator", "inplace", "ioperator", "out"],
    "cat": ["function", "keyword", "tuple", "out"],
}
INPLACE_FORMS = {"inplace": "inplace", "ioperator": "inplace", "out": "out"}


@st.composite
def nesting(draw):
    """A random sequence of entering and leaving disable_casts; returns the steps."""
    steps, depth = [], 0
    for _ in range(draw(st.integers(0, 5))):
        if depth and draw(st.booleans()):
            steps.append(-1)
            depth -= 1
        else:
            steps.append(+1)
            depth += 1
    return steps


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    assign=st.fixed_dictionaries({op: st.sampled_from(["bf16", "fp32", "promote", None]) for op in OPS}),
    op=st.sampled_from(OPS),
    data=st.data(),
    low=st.sampled_from([BF16, FP16]),
    device=st.sampled_from(DEVICES),
    steps=nesting(),
)
def test_rules_match_oracle(assign, op, data, low, device, steps):
    form = data.draw(st.sampled_from(FORMS[op]), label="form")
    n = 2 if op != "cat" else data.draw(st.integers(2, 4), label="n")
    dtypes = data.draw(st.lists(st.sampled_from(ALL_DTYPES), min_size=n, max_size=n), label="dtypes")
    kind = INPLACE_FORMS.get(form, "call")
    out = None
    target = None
    if kind == "inplace":
        assume(dtypes[0] in FLOATING and torch.complex64 not in dtypes)
        target = dtypes[0]
    if kind == "out":
        target = data.draw(st.sampled_from(FLOATING), label="out dtype")
        assume(torch.complex64 not in dtypes)
        out = torch.empty(0, device=device, dtype=target)
    tensors = [make(d, device) for d in dtypes]
    originals = [t.clone() for t in tensors]

    convert_with(assign, low)
    with contextlib.ExitStack() as stack:
        managers = []
        for step in steps:
            if step > 0:
                cm = hmp.disable_casts()
                cm.__enter__()
                managers.append(cm)
            else:
                managers.pop().__exit__(None, None, None)
        stack.callback(lambda: [m.__exit__(None, None, None) for m in reversed(managers)])
        disabled = bool(managers)
        assert hmp.casts_enabled() is (not disabled)
        fn, args, kwargs = call(op, form, tensors, out)
        try:
            expected = expected_call(fn, *args, **kwargs)
        except RuntimeError as e:
            expected = e
        try:
            with record_ops() as ran:
                result = fn(*args, **kwargs)
        except RuntimeError:
            # torch itself rejects some mixes (an in-place int result); the oracle, which runs
            # torch's op on the inputs the rules give, says so too
            assert isinstance(expected, RuntimeError), f"{op}/{form}: raised, the oracle says {expected}"
            event("torch rejected the mix")
            return
    event(f"checked {op}/{form}")
    assert not isinstance(expected, Exception), f"{op}/{form} ran, the oracle says it raises: {expected}"
    sent = tuple(t.dtype for t in tensors if t.dtype in FLOATING) + ((target,) if out is not None else ())
    want = sent if expected.left_to_torch else expected.received
    assert ran[0].inputs == want, f"{op}/{form} in {assign[op]}: sent {sent}, op got {ran[0].inputs}, want {want}"

    # the result is what torch gives for the oracle's inputs, computed without hmp
    cast = _cast_as(originals, want)
    out_copy = None if out is None else torch.empty(0, device=device, dtype=out.dtype)
    with hmp.disable_casts():
        plain_fn, plain_args, plain_kwargs = call(op, form, cast, out_copy)
        expect = plain_fn(*plain_args, **plain_kwargs)
    if not expected.left_to_torch:  # the dtype of the floating result (a complex one is none)
        assert expected.dtype == (result.dtype if result.dtype in FLOATING else None)
    if kind == "inplace":
        assert result is tensors[0] and result.dtype == dtypes[0]
    if kind == "out":
        assert result is out and out.dtype == target
    assert result.dtype == expect.dtype
    assert torch.equal(result, expect)
    # inputs are never mutated by a cast
    for i, (t, o, d) in enumerate(zip(tensors, originals, dtypes)):
        if kind == "inplace" and i == 0:
            continue
        assert t.dtype == d and torch.equal(t, o)
