"""A hypothesis state machine over convert (O1/O2, random lists, bf16/fp16,
cache on/off), revert, entering and leaving disable_casts, running ops,
training steps and failing calls. Invariants are checked after every step;
every sequence ends with revert() and torch pristine.

The expected dtypes come from an oracle written here from the documented
rules (README "Rules" and "List files"), not from hmp's code.
"""

import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same, snapshot
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import hmp

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
ROOT = Path(__file__).resolve().parents[2]
POOL = ["mm", "matmul", "linear", "relu", "softmax", "log", "exp", "tanh", "sin", "add", "sub", "mul", "div", "truediv"]

STATS = {"sequences": 0, "steps": 0, "ops checked": 0, "converts": 0, "failed converts": 0}


def _read(name):
    names = set()
    for line in (ROOT / "op_lists" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and "." not in line:  # op names; module entries are no ops
            names.add(line)
    return names


DEFAULTS = {f[:-4]: _read(f) for f in ("bf16.txt", "fp32.txt", "promote.txt", "o2_bf16.txt", "o2_fp32.txt", "fp16.txt")}


ONE_DTYPE = _read("one_dtype.txt")


def oracle_lists(opt, bf16, fp32, promote, low=BF16):
    """The effective lists, or ValueError, from the documented precedence
    (float16's O1 lower list is the GEMM/convolution one)."""
    if opt == "O2":
        b, f, ub, uf = set(DEFAULTS["o2_bf16"]), set(DEFAULTS["o2_fp32"]), False, False
    else:
        ub, uf = bf16 is not None, fp32 is not None
        b = set(bf16) if ub else set(DEFAULTS["fp16" if low == FP16 else "bf16"])
        f = set(fp32) if uf else set(DEFAULTS["fp32"])
    p = set(promote) if promote is not None else set(DEFAULTS["promote"])
    both = b & f
    if both:
        if ub and uf:
            return ValueError
        if ub:
            f -= both
        else:
            b -= both
    p -= b | f
    return {"bf16": b, "fp32": f, "promote": p}


_RANK = {FP16: 1, BF16: 1, FP32: 2}


def oracle_cast(kind, dtypes, low):
    if kind == "bf16":
        return [low if d == FP32 else d for d in dtypes]
    if kind == "fp32":
        return [FP32 for _ in dtypes]
    if kind == "promote":
        top = max(_RANK[d] for d in dtypes)
        widest = {d for d in dtypes if _RANK[d] == top}
        w = widest.pop() if len(widest) == 1 else FP32
        return [w for _ in dtypes]
    return list(dtypes)


# call form -> (list name, arity, shape class, function)
CALLS = {
    "torch.mm": ("mm", 2, "matmul", lambda a, b: torch.mm(a, b)),
    "torch.matmul": ("matmul", 2, "matmul", lambda a, b: torch.matmul(a, b)),
    "a @ b": ("matmul", 2, "matmul", lambda a, b: a @ b),
    "F.linear": ("linear", 2, "linear", lambda a, b: F.linear(a, b)),
    "torch.relu": ("relu", 1, "unary", lambda a: torch.relu(a)),
    "Tensor.softmax": ("softmax", 1, "unary", lambda a: a.softmax(-1)),
    "F.softmax": ("softmax", 1, "unary", lambda a: F.softmax(a, -1)),
    "torch.log": ("log", 1, "unary", lambda a: torch.log(a)),
    "torch.exp": ("exp", 1, "unary", lambda a: torch.exp(a)),
    "torch.tanh": ("tanh", 1, "unary", lambda a: torch.tanh(a)),
    "torch.sin": ("sin", 1, "unary", lambda a: torch.sin(a)),
    "torch.add": ("add", 2, "elementwise", lambda a, b: torch.add(a, b)),
    "a - b": ("sub", 2, "elementwise", lambda a, b: a - b),
    "a * b": ("mul", 2, "elementwise", lambda a, b: a * b),
    "torch.div": ("div", 2, "elementwise", lambda a, b: torch.div(a, b)),
    "a / b": ("truediv", 2, "elementwise", lambda a, b: a / b),
}
SHAPES = {"matmul": [(2, 4), (4, 3)], "linear": [(2, 4), (3, 4)], "unary": [(2, 4)], "elementwise": [(2, 4), (2, 4)]}

lists_or_default = st.one_of(st.none(), st.frozensets(st.sampled_from(POOL)))


class HmpMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        hmp.revert()
        assert hmp.casts_enabled(), "a previous sequence left disable_casts active"
        self.pristine = snapshot()
        self.lists = None  # the oracle's effective lists while converted
        self.low = None
        self.blocks = []
        self.dir = Path(tempfile.mkdtemp(prefix="hmp-sm-"))
        self.files = 0
        STATS["sequences"] += 1

    def _file(self, names):
        if names is None:
            return ""
        self.files += 1
        path = self.dir / f"{self.files}.txt"
        path.write_text("# state machine\n" + "\n".join(sorted(names)) + "\n")
        return path

    def _kind(self, name):
        if self.lists is None or self.blocks:
            return None
        return next((k for k in ("bf16", "fp32", "promote") if name in self.lists[k]), None)

    # -- rules ---------------------------------------------------------------------------------

    @rule(
        opt=st.sampled_from(["O1", "O2"]),
        bf16=lists_or_default,
        fp32=lists_or_default,
        promote=lists_or_default,
        low=st.sampled_from([BF16, FP16]),
        cache=st.booleans(),
    )
    def convert(self, opt, bf16, fp32, promote, low, cache):
        STATS["steps"] += 1
        expected = oracle_lists(opt, bf16, fp32, promote, low)
        kwargs = dict(
            opt_level=opt,
            bf16_file_path=self._file(bf16),
            fp32_file_path=self._file(fp32),
            promote_file_path=self._file(promote),
            low_precision_type=low,
            cache=cache,
        )
        if expected is ValueError:
            before = snapshot()
            with pytest.raises(ValueError, match="both the BF16 list"):
                hmp.convert(**kwargs)
            assert_same(before, snapshot())  # a failed convert() changes nothing
            STATS["failed converts"] += 1
            return
        if opt == "O2" and (bf16 is not None or fp32 is not None):
            with pytest.warns(UserWarning, match="O2"):
                hmp.convert(**kwargs)
        else:
            hmp.convert(**kwargs)
        STATS["converts"] += 1
        self.lists, self.low = expected, low

    @rule()
    def revert(self):
        STATS["steps"] += 1
        hmp.revert()
        self.lists = self.low = None

    @rule()
    def enter_disable_casts(self):
        STATS["steps"] += 1
        block = hmp.disable_casts()
        block.__enter__()
        self.blocks.append(block)

    @precondition(lambda self: self.blocks)
    @rule()
    def leave_disable_casts(self):
        STATS["steps"] += 1
        self.blocks.pop().__exit__(None, None, None)

    @rule(
        call=st.sampled_from(sorted(CALLS)),
        dtypes=st.lists(st.sampled_from([FP32, BF16, FP16]), min_size=2, max_size=2),
    )
    def run_op(self, call, dtypes):
        STATS["steps"] += 1
        name, arity, shape, fn = CALLS[call]
        dtypes = dtypes[:arity]
        with hmp.disable_casts():
            args = [(torch.rand(s) + 0.5).to(d) for s, d in zip(SHAPES[shape], dtypes)]
        kind = self._kind(name)
        if kind is None and self.lists is not None and not self.blocks and name in ONE_DTYPE:
            kind = "promote"  # an op in no list that needs one dtype (docs/never-changes.md)
        cast = oracle_cast(kind, dtypes, self.low)
        if shape in ("matmul", "linear") and cast[0] != cast[1]:
            with pytest.raises(RuntimeError):  # torch refuses mixed matmul inputs, as without hmp
                fn(*args)
            return
        expected = cast[0] if arity == 1 else torch.promote_types(*cast)
        out = fn(*args)
        assert out.dtype == expected, f"{call}{tuple(dtypes)} in {self._kind(name)}: {out.dtype} != {expected}"
        STATS["ops checked"] += 1

    @rule()
    def training_step(self):
        STATS["steps"] += 1
        with hmp.disable_casts():
            w = torch.randn(3, 4, requires_grad=True)
            b = torch.zeros(3, requires_grad=True)
            x = torch.randn(2, 4)
        out = F.linear(x, w, b)
        expected = oracle_cast(self._kind("linear"), [FP32], self.low)[0]
        assert out.dtype == expected
        out.float().sum().backward()
        assert w.dtype == FP32 and w.grad.dtype == FP32 and b.grad.dtype == FP32
        assert torch.isfinite(w.grad).all()

    @rule(where=st.sampled_from(["inside a wrapped op", "inside disable_casts", "inside a training step"]))
    def crash(self, where):
        STATS["steps"] += 1
        with pytest.raises(RuntimeError):
            if where == "inside a wrapped op":
                torch.mm(torch.ones(2, 3), torch.ones(2, 3))
            elif where == "inside disable_casts":
                with hmp.disable_casts():
                    raise RuntimeError("boom")
            else:
                w = torch.randn(3, 4, requires_grad=True)
                F.linear(torch.randn(2, 4), w).float().sum().backward()
                raise RuntimeError("crash between backward and step")

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def state_matches_the_model(self):
        assert hmp.casts_enabled() == (not self.blocks)
        assert hmp.is_converted() == (self.lists is not None)
        if self.lists is None:
            assert hmp.effective_lists() == {"bf16": [], "fp32": [], "promote": []}
            assert_same(self.pristine, snapshot())
        else:
            ops = {k: [n for n in v if "." not in n] for k, v in hmp.effective_lists().items()}  # module entries after
            assert ops == {k: sorted(v) for k, v in self.lists.items()}

    def teardown(self):
        while self.blocks:
            self.blocks.pop().__exit__(None, None, None)
        hmp.revert()
        assert hmp.casts_enabled() and not hmp.is_converted()
        assert_same(self.pristine, snapshot())  # revert always ends pristine


HmpMachine.TestCase.settings = settings(
    stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestHmpStateMachine = HmpMachine.TestCase


def test_state_machine_ran(request):
    """Runs after the machine (file order) and reports what it covered."""
    if STATS["sequences"] == 0:
        pytest.skip("the state machine did not run in this session")
    print("state machine:", STATS)
    assert STATS["ops checked"] > 0 and STATS["converts"] > 0
