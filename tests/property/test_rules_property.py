"""Property-based tests of the O1 cast rules against an oracle written here,
from the rules as documented, not from hmp's code.

What the op really received is observed with a TorchFunctionMode, which sees
the call hmp's wrapper makes to the original op, after any casts.
"""

import contextlib
import tempfile
from pathlib import Path

import torch
from helpers import DEVICES
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

import hmp

FP16, BF16, FP32, FP64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
FLOATING = [FP16, BF16, FP32, FP64]
ALL_DTYPES = FLOATING + [torch.int32, torch.int64, torch.bool, torch.complex64]

# -- the oracle ---------------------------------------------------------------

_WIDTH = {FP16: 1, BF16: 1, FP32: 2, FP64: 3}


def oracle_widest(dtypes):
    floats = [d for d in dtypes if d in _WIDTH]
    if not floats:
        return None
    top = max(_WIDTH[d] for d in floats)
    widest = {d for d in floats if _WIDTH[d] == top}
    if len(widest) == 1:
        return widest.pop()
    return FP32  # bf16 with fp16: neither holds the other; fp32 holds both


def oracle(category, form, dtypes, low, disabled, target=None):
    """The dtypes the op must receive, per the documented rules."""
    if disabled or category is None:
        return list(dtypes)
    if form in ("inplace", "out"):
        return [target if d in _WIDTH else d for d in dtypes]
    if category == "bf16":
        return [low if d == FP32 else d for d in dtypes]
    if category == "fp32":
        return [FP32 if d in (BF16, FP16) else d for d in dtypes]
    if category == "promote":
        w = oracle_widest(dtypes)
        return [w if d in _WIDTH else d for d in dtypes]
    raise AssertionError(category)


# -- observation ---------------------------------------------------------------


class Record(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen = []

        def visit(v):
            if isinstance(v, torch.Tensor):
                seen.append(v.dtype)
            elif isinstance(v, (list, tuple)):
                for x in v:
                    visit(x)

        visit(args)
        visit({k: v for k, v in kwargs.items() if k != "out"}.get("input", None))
        visit([v for k, v in kwargs.items() if k not in ("out", "input")])
        self.calls.append((getattr(func, "__name__", ""), seen))
        return func(*args, **kwargs)


def received(record, names):
    matching = [dtypes for fname, dtypes in record.calls if fname in names]
    assert matching, f"{names} never reached torch: {[c[0] for c in record.calls]}"
    return matching[-1]


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
    """Run ``op`` in ``form``; returns (result, names torch may report for it)."""
    a, b = tensors[0], tensors[1]
    if op == "cat":
        if form == "function":
            return torch.cat(list(tensors)), ("cat",)
        if form == "keyword":
            return torch.cat(tensors=list(tensors)), ("cat",)
        if form == "tuple":
            return torch.cat(tuple(tensors)), ("cat",)
        if form == "out":
            return torch.cat(list(tensors), out=out), ("cat",)
    fn = getattr(torch, op)
    if form == "function":
        return fn(a, b), (op,)
    if form == "keyword":
        return fn(input=a, other=b), (op,)
    if form == "method":
        return getattr(a, op)(b), (op,)
    if form == "operator":
        return (a + b if op == "add" else a * b), (f"__{op}__", op)
    if form == "inplace":
        return getattr(a, op + "_")(b), (op + "_",)
    if form == "ioperator":
        if op == "add":
            a += b
        else:
            a *= b
        return a, (f"__i{op}__", op + "_")
    if form == "out":
        return fn(a, b, out=out), (op,)
    raise AssertionError(form)


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
        record = Record()
        try:
            with record:
                result, torch_name = call(op, form, tensors, out)
        except RuntimeError:
            # torch itself rejects some mixes (e.g. an in-place int result);
            # then the same call without hmp must fail too
            expected_fail = True
        else:
            expected_fail = False
    event("torch rejected the mix" if expected_fail else f"checked {op}/{form}")
    if expected_fail:
        return

    category = assign[op]
    want = oracle(category, kind if kind != "call" else "call", dtypes, low, disabled, target)
    got = received(record, torch_name)
    assert got[: len(want)] == want, f"{op}/{form} in {category}: sent {dtypes}, op got {got}, want {want}"

    # the result is what torch gives for the oracle's inputs, computed without hmp
    with hmp.disable_casts():
        if kind == "inplace":
            expect = originals[0].clone()
            getattr(expect, op + "_")(originals[1].to(want[1]))
        else:
            cast = [o.to(w) for o, w in zip(originals, want)]
            expect = torch.cat(cast) if op == "cat" else getattr(torch, op)(*cast)
    if kind == "inplace":
        assert result is tensors[0] and result.dtype == dtypes[0]
    if kind == "out":
        assert result is out and out.dtype == target
        expect = expect.to(target)
    assert result.dtype == expect.dtype
    assert torch.equal(result, expect)
    # inputs are never mutated by a cast
    for i, (t, o, d) in enumerate(zip(tensors, originals, dtypes)):
        if kind == "inplace" and i == 0:
            continue
        assert t.dtype == d and torch.equal(t, o)
