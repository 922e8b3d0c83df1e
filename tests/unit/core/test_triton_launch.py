"""The saturating cast's Triton kernel launched without Triton's JIT after its first launch
(hmp/core/triton_launch.py, issue 66 item 3).

On any CPU: the version guard, the argument layout given to a compiled kernel's launcher on each
release family, the fallback to ``kernel[grid](...)`` (for good, on a mismatch or a failed first
direct launch), one compiled kernel per specialisation, each one's first direct launch checked
against the JIT's bits (issue 78 item 6: a launcher that writes other bits, faked here, turns the
JIT on for good with one warning), and Triton's interpreter (no compiled kernel: the JIT's launch,
and torch's bits). The launch itself runs on a GPU only
(``test_the_direct_launch_on_a_gpu``; benchmarks/gpu_checks.sh runs this file there).
"""

import ast
import os
import subprocess
import sys
import textwrap
import time
import types
import warnings
from pathlib import Path

import pytest
import torch
from helpers import TRITON_INTERPRETER_PROBE

import hmp
from hmp.core import saturating_cast, triton_launch

BF16, F16 = torch.bfloat16, torch.float16
TOP = {BF16: torch.finfo(BF16).max, F16: torch.finfo(F16).max}
PACKAGE = Path(hmp.__file__).resolve().parent


def same_bits(y, want):
    return bool(((y.view(torch.int16) == want.view(torch.int16)) | (y.isnan() & want.isnan())).all())


def values(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    edge = torch.tensor([0.0, -0.0, 3.4e38, -3.4e38, float("inf"), float("nan"), 65520.0, 1.00390625])
    return torch.cat([edge, torch.randn(max(n - 8, 0), generator=g) * 1e5])[:n]


class Compiled:
    """A compiled kernel as Triton returns it: ``run`` is its launcher, taking ``arity`` kernel
    arguments (a C launcher refuses any other count: TypeError) and writing the saturated cast."""

    def __init__(self, arity, backend="cuda", fail=False, wrong=None):
        self.src = types.SimpleNamespace(signature=dict.fromkeys(range(arity)))
        self.metadata = types.SimpleNamespace(target=types.SimpleNamespace(backend=backend))
        self.function, self.packed_metadata, self.arity, self.fail = 7, ("packed",), arity, fail
        self.wrong = wrong  # what a launcher given the wrong arguments writes instead: fn(src, dst)
        self.calls = []

    def run(self, *args):
        self.calls.append(args)
        if self.fail or len(args) != 9 + self.arity:
            raise TypeError(f"function takes exactly {9 + self.arity} arguments ({len(args)} given)")
        src, dst = args[9], args[10]
        if self.wrong is not None:
            self.wrong(src, dst)
            return
        dst.copy_(saturating_cast.stock(src, dst.dtype))


class OldCompiled(Compiled):  # Triton 3.0 to 3.3: the launch hooks are CompiledKernel's class attributes
    launch_enter_hook = launch_exit_hook = None


class Jit:
    """``kernel[grid](...)``: counts its launches, casts, returns a new compiled kernel each time
    (``made``) or what ``compiled`` returns (None: the interpreter)."""

    def __init__(self, compiled):
        self.compiled, self.launches, self.made, self.pre_run_hooks = compiled, [], [], []

    def __getitem__(self, grid):
        def launch(src, dst, n, top, BLOCK, BF16):
            assert BF16 is (dst.dtype is torch.bfloat16) and top == TOP[dst.dtype] and n == src.numel()
            self.launches.append(grid)
            dst.copy_(saturating_cast.stock(src, dst.dtype))
            made = self.compiled()
            if made is not None:
                self.made.append(made)
            return made

        return launch


def fake_triton(version, knobs=True):
    hooks = types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[]), launch_exit_hook=None)
    found = types.SimpleNamespace(__version__=version)
    if knobs:
        found.knobs = types.SimpleNamespace(runtime=hooks)
    return found


DRIVER = types.SimpleNamespace(active=types.SimpleNamespace(get_current_stream=lambda device: 5000 + device))


def launcher(version="3.9.0", compiled=None, knobs=True, capturing=None):
    arity = 6 if triton_launch.release(version) >= (3, 3) else 4
    jit = Jit(compiled or (lambda: Compiled(arity)))
    found = triton_launch.Launcher(fake_triton(version, knobs), jit, 1024, driver=DRIVER, capturing=capturing)
    return found, jit


def cast(launch, t, dtype=BF16):
    y = torch.empty_like(t, dtype=dtype)
    launch(t, y, t.numel(), TOP[dtype], dtype is BF16)
    assert same_bits(y, saturating_cast.stock(t, dtype))
    return y


# -- the guard --------------------------------------------------------------------------------------


def test_release_reads_triton_versions():
    assert triton_launch.release("3.9.0") == (3, 9)
    assert triton_launch.release("3.0.0+git1234abc") == (3, 0)
    assert triton_launch.release("3.10.1") == (3, 10)
    assert triton_launch.release("") is None and triton_launch.release("dev") is None


@pytest.mark.parametrize(
    "version, arguments",
    [("2.3.1", None), ("3.0.0", 13), ("3.2.0", 13), ("3.3.1", 15), ("3.6.0", 15), ("3.9.0", 15), ("3.10.0", None)],
)
def test_each_release_gets_its_launchers_arguments_or_the_jits_launch(version, arguments):
    """3.0 to 3.2: grid, stream, function, metadata, no launch metadata, no hooks, then the four
    non-constexpr arguments; from 3.3 BLOCK and BF16 too; other releases: the JIT's launch always."""
    launch, jit = launcher(version)
    t = values(4096)
    for dtype in (BF16, F16, BF16):
        cast(launch, t, dtype)
    if arguments is None:
        assert not launch.direct and len(jit.launches) == 3 and launch.kernels == {}
        return
    assert launch.direct and len(jit.launches) == 2  # one per target dtype, then the compiled kernel's own
    check, args = jit.made[0].calls  # its first direct launch, checked against the JIT's bits; then the third cast
    assert check[9] is t and check[10] is not args[10] and len(check) == len(args) == arguments
    assert args[:9] == (4, 1, 1, 4999, 7, ("packed",), None, None, None)  # 4096 / 1024 blocks; device -1's stream
    assert args[9] is t and args[11:13] == (4096, TOP[BF16])
    assert args[13:] == ((1024, True) if arguments == 15 else ())


def test_one_compiled_kernel_per_specialisation():
    """Triton compiles a kernel per pointer alignment, ``n`` divisible by 16, ``n`` equal to 1: a
    source of another kind goes through the JIT once, then takes its own compiled kernel."""
    launch, jit = launcher()
    x = values(4096)
    kinds = [x, x[1:], x[:17], x[:1], x[16:48]]  # aligned; not aligned; n % 16; n == 1; aligned again, n % 16 == 0
    for t in kinds:
        cast(launch, t)
    assert len(jit.launches) == 4  # x[16:48] is x's specialisation: its compiled kernel
    for t in kinds:
        cast(launch, t)
    assert len(jit.launches) == 4 and len(launch.kernels) == 4
    assert [len(c.calls) for c in jit.made] == [4, 2, 2, 2]  # each one's check, then its casts


@pytest.mark.parametrize(
    "compiled, why",
    [
        (lambda: Compiled(5), "a signature the layout does not fit"),
        (lambda: Compiled(6, backend="hip"), "ROCm: another backend"),
        (lambda: None, "the interpreter: no compiled kernel"),
        (lambda: types.SimpleNamespace(run=print), "a compiled kernel without Triton's names"),
    ],
)
def test_a_mismatch_takes_the_jits_launch_for_good(compiled, why):
    launch, jit = launcher(compiled=compiled)
    t = values(3000)
    for _ in range(4):
        cast(launch, t)
    assert not launch.direct and len(jit.launches) == 4, why
    assert all(not getattr(c, "calls", ()) for c in jit.made)


def test_a_failed_first_direct_launch_falls_back_once_and_for_good():
    """The direct launch raises (a launcher that takes other arguments): its first try, the check
    beside the JIT's first launch, raises; that cast and every later one are the JIT's, with torch's
    bits; the direct launch is not tried again."""
    launch, jit = launcher(compiled=lambda: Compiled(6, fail=True))
    t = values(2048)
    cast(launch, t)  # the JIT's launch, then the one direct try: it raises
    assert not launch.direct and len(jit.launches) == 1 and len(jit.made[0].calls) == 1
    for dtype in (BF16, F16, BF16):
        cast(launch, t, dtype)
    assert len(jit.launches) == 4 and sum(len(c.calls) for c in jit.made) == 1


def _truncated(src, dst):  # bfloat16 by dropping the low bits: no rounding, no saturation
    dst.copy_(src.view(torch.int32).bitwise_right_shift(16).to(torch.int16).view(dst.dtype))


def _one_bit_off(src, dst):
    dst.copy_(saturating_cast.stock(src, dst.dtype))
    dst.view(-1)[-1:].view(torch.int16).bitwise_xor_(1)


WRONG = {  # what a launcher that accepts its arguments and misreads them might write
    "nothing": lambda src, dst: None,
    "one bit off": _one_bit_off,
    "truncated, not rounded": _truncated,
}


@pytest.mark.parametrize("wrong", sorted(WRONG))
def test_a_launcher_that_writes_other_bits_turns_the_jit_on_for_good_with_one_warning(wrong):
    """A launcher that accepts the arguments it is given and writes wrong bits (the argument layout
    misread for a release): the first direct launch of a specialisation runs on the input the JIT
    just cast, and its bits differ, so every cast, that one included, is the JIT's, with torch's
    bits; one warning, and no direct launch again (other specialisations included)."""
    launch, jit = launcher(compiled=lambda: Compiled(6, wrong=WRONG[wrong]))
    x = values(3000)
    with pytest.warns(RuntimeWarning, match="gave other bits than Triton's own launch") as said:
        cast(launch, x)
    assert len(said) == 1 and not launch.direct and launch.kernels == {}
    assert len(jit.launches) == 1 and len(jit.made[0].calls) == 1  # the check: its output went nowhere
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype in (BF16, F16):
            for t in (x, x[1:], x[:17], x):
                cast(launch, t, dtype)
    assert len(jit.launches) == 9 and sum(len(c.calls) for c in jit.made) == 1


def test_a_right_launcher_is_checked_once_per_specialisation():
    """The check costs one direct launch and one comparison per specialisation, not per cast."""
    launch, jit = launcher()
    x = values(3000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            for t in (x, x[1:], x[:32]):  # aligned; not aligned; n divisible by 16
                cast(launch, t)
    assert launch.direct and len(launch.kernels) == 3 and len(jit.launches) == 3
    assert [len(c.calls) for c in jit.made] == [1 + 2] * 3  # its check, then two direct casts


def test_no_check_while_a_cuda_graph_is_captured():
    """A comparison reads the device, which a capture forbids: while one runs the JIT launches and
    nothing is kept; the next launch outside it makes the direct launch and checks it."""
    capturing = [True]
    launch, jit = launcher(capturing=lambda: capturing[0])
    t = values(2048)
    cast(launch, t)
    cast(launch, t)
    assert launch.direct and launch.kernels == {} and len(jit.launches) == 2
    assert all(c.calls == [] for c in jit.made)
    capturing[0] = False
    cast(launch, t)  # the JIT's launch, its check
    cast(launch, t)  # direct
    assert len(launch.kernels) == 1 and len(jit.launches) == 3 and len(jit.made[2].calls) == 2


def test_a_layout_the_compiled_kernel_disagrees_with_falls_back():
    launch, jit = launcher("3.9.0", compiled=lambda: Compiled(6))
    launch.all_args = False  # as if a release gave the constexprs no more: a launcher call that raises
    t = values(2048)
    cast(launch, t)
    assert not launch.direct  # the signature's six entries disagree with four arguments
    launch, jit = launcher("3.2.0", compiled=lambda: Compiled(4))
    jit.compiled = lambda: Compiled(4, fail=True)
    cast(launch, t)
    cast(launch, t)
    assert not launch.direct and len(jit.launches) == 2


def test_launch_hooks_and_pre_run_hooks_take_the_jit():
    """A profiler's launch hook (knobs on 3.4+, CompiledKernel's class attribute before) wants the
    launch metadata the JIT computes: while one is in force a cast goes through the JIT."""
    launch, jit = launcher()
    t = values(1024)
    cast(launch, t)
    cast(launch, t)
    assert len(jit.launches) == 1
    launch.hooks.launch_enter_hook.calls.append(print)
    cast(launch, t)
    assert len(jit.launches) == 2
    launch.hooks.launch_enter_hook.calls.clear()
    jit.pre_run_hooks.append(print)
    cast(launch, t)
    assert len(jit.launches) == 3
    jit.pre_run_hooks.clear()
    cast(launch, t)
    assert len(jit.launches) == 3 and launch.direct

    launch, jit = launcher("3.1.0", compiled=lambda: OldCompiled(4), knobs=False)
    cast(launch, t)
    cast(launch, t)
    assert launch.direct and launch.hooks is OldCompiled and len(jit.launches) == 1
    OldCompiled.launch_exit_hook = print
    try:
        cast(launch, t)
    finally:
        OldCompiled.launch_exit_hook = None
    assert len(jit.launches) == 2
    launch, jit = launcher("3.1.0", compiled=lambda: Compiled(4), knobs=False)  # no hooks where expected
    cast(launch, t)
    assert not launch.direct


def test_the_cast_takes_the_launcher(monkeypatch):
    """saturating_cast's ``launch`` (every CUDA cast) goes through the launcher, in each layout."""
    launch, jit = launcher()
    monkeypatch.setattr(saturating_cast, "launcher", lambda: launch)
    x = values(64 * 100).view(64, 100)
    for dtype in (BF16, F16):
        for t in (x, x.t(), x[:, ::3]):
            y = saturating_cast._cast(t, dtype)
            assert same_bits(y, saturating_cast.stock(t, dtype)) and y.dtype is dtype
    assert launch.direct and len(jit.launches) == 2  # one specialisation per dtype: the rest direct
    assert sum(len(c.calls) for c in jit.made) == 6  # each one's check, then the four casts it did not launch


# -- one home for Triton's launcher ------------------------------------------------------------------

TRITON_LAUNCHER_NAMES = {"packed_metadata", "launch_enter_hook", "launch_exit_hook", "get_current_stream"}
TRITON_LAUNCHER_NAMES |= {"pre_run_hooks", "knobs", "launcher_cls"}


def test_tritons_launcher_is_reached_from_one_module():
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node, "attr", None) or (node.value if isinstance(node, ast.Constant) else None)
            if name in TRITON_LAUNCHER_NAMES:
                found.add(path.relative_to(PACKAGE).as_posix())
    assert found == {"core/triton_launch.py"}


# -- Triton itself: its interpreter on the CPU, its launcher on a GPU ---------------------------------

_INTERPRETED = TRITON_INTERPRETER_PROBE + textwrap.dedent(
    """
    from hmp.core import saturating_cast as sc, triton_launch

    launch = sc.launcher()
    found = triton_launch.release(triton.__version__)
    assert launch.direct is (triton_launch.FIRST <= found <= triton_launch.LAST), (found, launch.direct)
    x = torch.tensor([0.0, 3.4e38, -3.4e38, float("inf"), float("nan"), 65520.0, 1.00390625] * 300)
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        for t in (x, x[1:], x[:17]):
            y = sc._cast(t, dtype)
            want = sc.stock(t, dtype)
            assert ((y.view(torch.int16) == want.view(torch.int16)) | (y.isnan() & want.isnan())).all(), dtype
    assert launch.direct is False and launch.kernels == {}
    print("INTERPRETED", triton.__version__)
    """
)


def test_tritons_interpreter_has_no_compiled_kernel_so_the_jit_launches():
    pytest.importorskip("triton")
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETED],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if "INTERPRETER COPIES WRONG" in done.stderr:
        pytest.skip("this Triton's interpreter gets a plain copy wrong: " + done.stderr.strip()[-200:])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "INTERPRETED" in done.stdout


class CountingJit:
    def __init__(self, jit):
        self.jit, self.launches, self.pre_run_hooks = jit, 0, jit.pre_run_hooks

    def __getitem__(self, grid):
        self.launches += 1
        return self.jit[grid]


def _host_us(fn, t, reps=2000):
    fn(t)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn(t)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel's launcher runs on a GPU")
def test_the_direct_launch_on_a_gpu(monkeypatch):
    """Each specialisation through the JIT once, then the compiled kernel's launcher: torch's bits,
    on the current stream (a side stream, a captured CUDA graph). Prints host µs per cast."""
    triton = pytest.importorskip("triton")
    _, k = saturating_cast.kernel()
    jit = CountingJit(k)
    launch = triton_launch.Launcher(triton, jit, saturating_cast.BLOCK)
    on = launch.direct
    monkeypatch.setattr(saturating_cast, "launcher", lambda: launch)
    x = values(1 << 20).cuda()
    kinds = [x, x[1:], x[:17], x[:1], x[: 1 << 12].view(64, 64).t(), x[::3], x[16 : 16 + 4096]]
    for dtype in (BF16, F16):
        for rounds in range(3):
            for t in kinds:
                y = saturating_cast._cast(t, dtype)
                assert same_bits(y, saturating_cast.stock(t, dtype)), (dtype, t.shape, t.stride())
            if rounds == 0:
                first = jit.launches
        assert jit.launches == first or not on, (jit.launches, first)  # later rounds: no JIT launch
    assert launch.direct is on and (len(launch.kernels) > 0) is on
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = saturating_cast._cast(x, BF16)
    side.synchronize()
    assert same_bits(y, saturating_cast.stock(x, BF16))
    graph, static = torch.cuda.CUDAGraph(), x.clone()
    with torch.cuda.graph(graph):
        out = saturating_cast._cast(static, BF16)
    static.copy_(values(1 << 20, seed=1).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(out, saturating_cast.stock(static, BF16))
    small = x[:512]
    direct = _host_us(lambda t: saturating_cast._cast(t, BF16), small)
    through_jit = _host_us(
        lambda t: k[(1,)](t, torch.empty_like(t, dtype=BF16), 512, TOP[BF16], BLOCK=1024, BF16=True), small
    )
    print(f"\nTriton {triton.__version__}: direct {on}; host+device µs per cast: {direct:.1f}, JIT's {through_jit:.1f}")
