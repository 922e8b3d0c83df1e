"""hmp's wrapper body in C (issue 33): µs each wrapper adds over bare torch.

    python benchmarks/cbody/build.py
    python benchmarks/cbody/bench.py [--reps 31] [--calls 2000] [--json out.json]

hmp is converted once; for every listed call site the C wrappers are built
from the Python wrapper's own closure cells (op, prepare, src, cast, refuse,
...), so both run the same rule with the same casters and cache. Each sample
installs one implementation at the site (``F.linear``, ``torch.mm``,
``torch.Tensor.mm`` ...) and times ``calls`` calls made through the site, as
a model makes them. Modes, interleaved sample by sample (order rotated each
rep): bare torch, torch.autocast (bf16), hmp's Python wrapper, the C wrapper
as one abi3 binary (``_cbody``) and built for this interpreter
(``_cbody_full``). Cases and contexts as benchmarks/percall.py's: 8x8
tensors, one thread, training linear with an input that requires grad and
one output kept alive (hmp's cache hits the weight), inference inside
``hmp.frozen_weights()`` / one autocast region.

``check()`` runs first: the C wrappers give the Python wrapper's results,
dtypes and gradients on those calls and on the paths they hand to Python.
"""

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import sys
import time
import types
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import hmp
from hmp.core import fallback, policy, state, wrap
from hmp.diagnostics import culprit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cbody  # noqa: E402  (python benchmarks/cbody/build.py)
import _cbody_full  # noqa: E402

SIZE = 8
C_MODULES = {"c abi3": _cbody, "c full": _cbody_full}
MODES = ("bare", "autocast", "py", *C_MODULES)


# --- the Python parts the C body calls -------------------------------------------------------------


def _after(a, args, k, kwargs):
    """The write-back step of wrap._body, run by the C body only after a call that cast something."""
    if not torch.compiler.is_compiling():
        policy.write_back(a, args, k, kwargs)


def _from_the_op(exc):
    raise exc


# a frame of _from_the_op stands for the wrapper frame culprit.raised_by_the_op looks for
culprit.register_wrapper(_from_the_op.__code__, lambda frame: None)


def _rescue(exc, op, wrapped, args, kwargs, a, k):
    """fallback.rescue for the C body. The C body has no frame, so an
    exception straight out of a C op reaches it with no traceback at all:
    that is the C body's "raised by the op" (an integration would tell
    fallback so; here a frame culprit knows is put on the traceback)."""
    if exc.__traceback__ is None:
        try:
            _from_the_op(exc)
        except BaseException:
            pass
    return fallback.rescue(exc, op, wrapped, args, kwargs, a, k)


def setup(module, rescue=_rescue):
    """Hand a C module what it calls: torch's types, hmp's constants, the Python steps."""
    steps = {
        "tensor": torch.Tensor,
        "parameter": nn.Parameter,
        "floats": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
        "promote": wrap.PROMOTE,
        "off": state.OFF,
        "cast_seq": policy.cast_seq,
        "is_number": policy._is_number,
        "after": _after,
        "rescue": rescue,
        "raise_": fallback.RAISE,
        "method_type": types.MethodType,
    }
    module.setup(**steps)


for _mod in C_MODULES.values():
    setup(_mod)


def cells(pyw):
    return {n: c.cell_contents for n, c in zip(pyw.__code__.co_freevars, pyw.__closure__)}


def c_wrapper(pyw, module=_cbody):
    """The C wrapper doing what hmp's Python wrapper ``pyw`` does, from its closure cells."""
    c = cells(pyw)
    w = module.Wrapper(
        c["op"],
        c["prepare"],
        c["src"],
        c["cast"],
        c["refuse"],
        c["inplace_at"],
        c["hidden"],
        c["needs"],
        state.tls,
        wrapped=c["wrapped"],
    )
    functools.update_wrapper(w, pyw)  # __name__, __doc__, __wrapped__ ... in the instance __dict__
    return w


# --- the calls -------------------------------------------------------------------------------------


def tensors():
    torch.manual_seed(0)
    x, a, b = (torch.randn(SIZE, SIZE) for _ in range(3))
    h = torch.randn(SIZE, SIZE, requires_grad=True)  # an activation inside a training forward
    w = nn.Parameter(torch.randn(SIZE, SIZE))
    bias = nn.Parameter(torch.randn(SIZE))
    return x, a, b, h, w, bias


def cases():
    """case -> (grad enabled, namespace, attribute, the call made through it)."""
    x, a, b, h, w, bias = tensors()
    return {
        "linear (training)": (True, F, "linear", lambda: F.linear(h, w, bias)),
        "linear (inference)": (False, F, "linear", lambda: F.linear(x, w, bias)),
        "mm": (False, torch, "mm", lambda: torch.mm(a, b)),
        "softmax (fp32, no cast)": (False, torch, "softmax", lambda: torch.softmax(x, -1)),
        "cat (one dtype, no cast)": (False, torch, "cat", lambda: torch.cat([a, b])),
        "Tensor.mm method (a.mm(b))": (False, torch.Tensor, "mm", lambda: a.mm(b)),
    }


def implementations(table, originals):
    """case -> {mode: what the site holds in that mode}; hmp converted."""
    out = {}
    for case, (_, ns, attr, _) in table.items():
        pyw = getattr(ns, attr)
        assert wrap.is_wrapper(pyw), (case, pyw)
        impl = {"bare": originals[(ns, attr)], "autocast": originals[(ns, attr)], "py": pyw}
        impl.update({m: c_wrapper(pyw, mod) for m, mod in C_MODULES.items()})
        out[case] = impl
    return out


@contextlib.contextmanager
def installed(ns, attr, impl):
    before = getattr(ns, attr)
    setattr(ns, attr, impl)
    try:
        yield
    finally:
        setattr(ns, attr, before)


@contextlib.contextmanager
def mode_context(mode, grad):
    with torch.set_grad_enabled(grad), contextlib.ExitStack() as stack:
        if mode == "autocast":
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        elif mode not in ("bare",) and not grad:
            stack.enter_context(hmp.frozen_weights())
        yield


def sample(fn, calls):
    keep = fn()  # in training, a live graph holding the weight's cast copy
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    del keep
    return elapsed / calls * 1e6


# --- correctness -----------------------------------------------------------------------------------


def _same(p, c):
    if isinstance(p, torch.Tensor):
        return isinstance(c, torch.Tensor) and p.dtype == c.dtype and torch.equal(p, c)
    if isinstance(p, (tuple, list)):
        return type(p) is type(c) and len(p) == len(c) and all(_same(x, y) for x, y in zip(p, c))
    return p == c


def check():
    """[(what, ok)]: the C wrappers against the Python wrapper. hmp converted."""
    results = []

    def compare(what, pyw, call, grad=False, params=()):
        outs = {}
        for mode, w in [("py", pyw)] + [(m, c_wrapper(pyw, mod)) for m, mod in C_MODULES.items()]:
            for p in params:
                p.grad = None
            state.warned.clear()  # warn-once: each mode warns afresh
            with torch.set_grad_enabled(grad), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = call(w)
                off_after = state.tls.off
                if grad:
                    out.float().sum().backward()
            outs[mode] = (out, [p.grad for p in params], off_after, [str(x.message)[:40] for x in caught])
        ref = outs["py"]
        for mode in C_MODULES:
            o = outs[mode]
            ok = _same(ref[0], o[0]) and _same(ref[1], o[1]) and o[2] == ref[2] == 0 and o[3] == ref[3]
            results.append((f"{what} [{mode}]: {_dtypes(o[0])}", ok))

    x, a, b, h, w, bias = tensors()
    table = cases()
    for case, (_grad, ns, attr, _) in table.items():
        pyw = getattr(ns, attr)
        if case.startswith("linear (training)"):
            compare(case + " + grads", pyw, lambda f: f(h, w, bias), True, (h, w, bias))
        elif case.startswith("linear"):
            compare(case, pyw, lambda f: f(x, w, bias))
        elif case == "softmax (fp32, no cast)":
            compare(case, pyw, lambda f: f(x, -1))
            compare("softmax of bf16 (cast to fp32)", pyw, lambda f: f(x.bfloat16(), -1))
        elif case.startswith("cat"):
            compare(case, pyw, lambda f: f([a, b]))
            compare("cat of fp32 and bf16 (promote: Python prepare)", pyw, lambda f: f([a, b.bfloat16()]))
            compare("cat((a, b), 0)", pyw, lambda f: f((a, b), 0))
        elif case.startswith("Tensor.mm"):
            with installed(ns, attr, None):
                for mode, cw in [("py", pyw)] + [(m, c_wrapper(pyw, mod)) for m, mod in C_MODULES.items()]:
                    torch.Tensor.mm = cw
                    bound, unbound = a.mm(b), torch.Tensor.mm(a, b)
                    results.append(
                        (
                            f"a.mm(b) and Tensor.mm(a, b) with the wrapper on the class [{mode}]: {_dtypes(bound)}",
                            _same(bound, unbound) and bound.dtype == torch.bfloat16,
                        )
                    )
        else:
            compare(case, pyw, lambda f: f(a, b))
    lin = F.linear
    compare("F.linear(x, w, bias=bias) (keywords: Python prepare)", lin, lambda f: f(x, w, bias=bias))
    compare("F.linear of bf16 input (nothing to cast for it)", lin, lambda f: f(x.bfloat16(), w, bias))

    def disabled(f):
        with hmp.disable_casts():
            return f(x, w, bias)

    compare("F.linear inside disable_casts()", lin, disabled)

    # paths the bench cases never take: numbers (refuse, decay), hidden writes, the op's state, rescue
    low, casters = torch.bfloat16, hmp.core.cache.casters()

    def site(op, name, hidden=False):
        rule = policy.lower(low, casters, None, name)
        return wrap.make(
            op,
            rule,
            None,
            src=policy.FP32_ONLY,
            cast=casters[low],
            refuse=policy.numbers_check(low, name),
            hidden=hidden,
        )

    def scale(t, s):
        return t * s

    compare("x * 1e39 (refuse: FP32 rule)", site(scale, "scale"), lambda f: f(x, 1e39))
    compare("x * 2.0 (numbers fine)", site(scale, "scale"), lambda f: f(x, 2.0))
    compare("mul(x, 0.995) (decay: Python cast_seq)", site(scale, "mul"), lambda f: f(x, 0.995))
    import numpy as np

    compare("x * np.float64(1e39) (a numpy number)", site(scale, "scale"), lambda f: f(x, np.float64(1e39)))

    def write(t, u):
        t.add_(1.0)  # a write hmp's schema check cannot see: write-back carries it to the caller's tensor
        return t + u

    def call_write(f):
        t = x.clone()
        out = f(t, a)
        return out, t

    compare("hidden write into a cast copy (after: write-back)", site(write, "write", hidden=True), call_write)

    def seen_off(t):
        return torch.tensor(float(state.tls.off))

    compare("state.off inside the op", site(seen_off, "seen"), lambda f: f(x))

    def boom(t):
        raise ValueError("boom")

    raising = [("py", site(boom, "boom"))] + [(m, c_wrapper(site(boom, "boom"), mod)) for m, mod in C_MODULES.items()]
    for name, f in raising:
        try:
            f(x)
            ok = False
        except ValueError:
            ok = state.tls.off == 0
        results.append((f"an op that raises: the error comes out, off back to 0 [{name}]", ok))
    # the C op (torch.geqrf is hmp's wrapper now); no bf16 kernel on CPU: rescue runs it uncast, with a warning
    geqrf = site(torch._C._VariableFunctions.geqrf, "geqrf")
    compare("geqrf: no bf16 kernel (rescue, warning)", geqrf, lambda f: f(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        geqrf_cells = cells(geqrf)
        names = ("op", "prepare", "src", "cast", "refuse", "inplace_at", "hidden", "needs")
        raw = _cbody.Wrapper(*[geqrf_cells[n] for n in names], state.tls)
        setup(_cbody, rescue=fallback.rescue)
        try:
            raw(x)
            ok = False
        except NotImplementedError:
            ok = True  # fallback.rescue as it is finds no wrapper frame: the C body needs the check above
        finally:
            setup(_cbody)
        results.append(("geqrf with fallback.rescue unadapted: raises (no wrapper frame) [c abi3]", ok))

    # the thread-local state: one thread inside disable_casts(), one casting, at the same time
    import threading

    cw, got = c_wrapper(F.linear), {}

    def worker(name, off):
        with hmp.disable_casts() if off else contextlib.nullcontext():
            got[name] = {cw(x, w, bias).dtype for _ in range(2000)}

    threads = [threading.Thread(target=worker, args=(n, n == "off")) for n in ("off", "on")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.append(
        (
            f"two threads at once: {got}",
            got == {"off": {torch.float32}, "on": {torch.bfloat16}} and state.tls.off == 0,
        )
    )
    # pause/retire: prepare None -> plain call of op
    cw = c_wrapper(F.linear)
    cw.prepare = None
    results.append(("prepare set to None (paused): a plain call", cw(x, w, bias).dtype == torch.float32))
    return results


def _dtypes(v):
    if isinstance(v, torch.Tensor):
        return str(v.dtype).replace("torch.", "")
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_dtypes(x) for x in v) + ")"
    return type(v).__name__


# --- timing ----------------------------------------------------------------------------------------


def run(reps, calls, progress=print):
    table = cases()
    originals = {(ns, attr): getattr(ns, attr) for _, ns, attr, _ in table.values()}
    hmp.convert()
    try:
        checks = check()
        impls = implementations(table, originals)
        samples = {c: {m: [] for m in MODES} for c in table}
        dtypes = {}
        for case, (grad, ns, attr, fn) in table.items():  # warm-up, and what each mode returns
            for mode in MODES:
                with installed(ns, attr, impls[case][mode]), mode_context(mode, grad):
                    for _ in range(200):
                        out = fn()
                dtypes.setdefault(case, {})[mode] = str(out.dtype).replace("torch.", "")
        for rep in range(reps):
            order = MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]
            for case, (grad, ns, attr, fn) in table.items():
                for mode in order:
                    gc.collect()
                    with installed(ns, attr, impls[case][mode]), mode_context(mode, grad):
                        samples[case][mode].append(sample(fn, calls))
            progress(f"  rep {rep + 1}/{reps}")
    finally:
        hmp.revert()
    return checks, {case: _summary(per_mode, dtypes[case]) for case, per_mode in samples.items()}


def _summary(per_mode, dtypes):
    """One case's medians, what each mode adds over bare torch, and what C
    saves: py - C per rep (the samples of one rep ran back to back)."""
    med = {m: statistics.median(v) for m, v in per_mode.items()}
    paired = sorted(p - c for p, c in zip(per_mode["py"], per_mode["c abi3"]))
    q1, _, q3 = statistics.quantiles(paired, n=4)
    return {
        "median_us": med,
        "added_us": {m: med[m] - med["bare"] for m in MODES if m != "bare"},
        "saves_us": {"median": statistics.median(paired), "q1": q1, "q3": q3},
        "dtype": dtypes,
    }


def report(checks, result):
    lines = ["checks (C wrapper vs hmp's Python wrapper):"]
    lines += [f"  {'ok  ' if ok else 'FAIL'} {what}" for what, ok in checks]
    lines += [
        "",
        "| call | bare (us) | autocast added | py added | C abi3 added | C full added "
        "| C abi3 saves (paired median [IQR]) | dtypes |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    return "\n".join(lines + [_row(case, r) for case, r in result.items()])


def _row(case, r):
    a, d, v = r["added_us"], r["dtype"], r["saves_us"]
    return (
        f"| {case} | {r['median_us']['bare']:.2f} | {a['autocast']:+.2f} | {a['py']:+.2f} | "
        f"{a['c abi3']:+.2f} | {a['c full']:+.2f} | {v['median']:.2f} [{v['q1']:.2f}, {v['q3']:.2f}] | "
        f"{'/'.join(sorted(set(d.values())))} |"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, kind, default in (("--reps", int, 31), ("--calls", int, 2000), ("--json", str, None)):
        parser.add_argument(flag, type=kind, default=default)
    args = parser.parse_args()
    torch.set_num_threads(1)
    checks, result = run(args.reps, args.calls, progress=lambda s: print(s, file=sys.stderr))
    print(
        f"torch {torch.__version__}, Python {sys.version.split()[0]}, {SIZE}x{SIZE} tensors on cpu, medians of "
        f"{args.reps} interleaved samples of {args.calls} calls, one thread"
    )
    print(report(checks, result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checks": checks, "result": result}, f, indent=1)
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
