"""Microseconds each mixed-precision scheme adds to one call, against bare torch and the floor.

    python benchmarks/percall.py [--reps 61] [--calls 1000] [--device cpu] [--json out.json]
    python benchmarks/percall.py --profile          # cProfile of hmp's calls: where its time goes

The table of the per-call issues: ``F.linear`` in a training forward and in
inference (inside ``hmp.frozen_weights()``, and under a plain
``torch.no_grad()``), ``torch.mm`` and ``a.mm(b)`` (a Tensor method) of two
activations, ``torch.softmax`` of float32 (FP32 list: nothing to cast) and
``torch.cat`` of one dtype (promote list: nothing to cast), on 8x8 tensors,
so the numbers are the schemes' overhead, not the kernels'.

**The floor** (issue 48) is the smallest Python wrapper with hmp's
guarantees: the same casts, the same saturation check (a cast to bf16 keeps a
finite value finite: ``aminmax`` and two ``.item()`` reads, saturating only
when something lies beyond the range) and a dict as the weight cache, one
function per op and nothing else (no thread state, no compile or trace
checks, no version check of a cached weight). It is the limit of a design
that wraps each listed call in Python; every hmp row says its distance to it.

Every call goes through the site (``F.linear``, ``torch.mm``, ...) as a
model's does, and per sample the site holds one implementation: torch's own
(bare, and autocast, which adds its region), the floor's or hmp's wrapper. hmp
is converted once; the modes interleave sample by sample, their order rotated
each rep, and what a mode adds is the median over reps of its sample minus
that rep's bare one (the distance to the floor: minus that rep's floor one).
Weight casts are reused by each scheme as it allows, for one sample (a
region): in training (an input that requires grad, as inside a model, one
output kept alive) hmp's cache reuses a copy while a live graph holds it and
autocast's region caches it; in inference hmp runs inside
``hmp.frozen_weights()`` or a plain ``torch.no_grad()`` block (one per
sample: hmp keeps the casts for the block) and autocast inside one region;
the floor's dict lives for the sample.

Targets (issue 48): hmp within +1.0 us of the floor for every call in
inference (inside ``frozen_weights()`` and under plain ``no_grad``), within
+2.0 us in training.
"""

import argparse
import contextlib
import cProfile
import functools
import gc
import json
import pstats
import statistics
import warnings
from pathlib import Path

import floor as floor_module  # benchmarks/floor.py, beside this file
import torch
import torch.nn as nn
import torch.nn.functional as F

import hmp
from hmp.tools.launches import count
from hmp.tools.progress import Progress
from hmp.tools.timing import per_call, quartiles, rotated

SIZE = 8
# case -> (grad enabled, inside frozen_weights(), hmp's limit over the floor in us)
CASES = {
    "linear (training)": (True, False, 2.0),
    "linear (frozen_weights)": (False, True, 1.0),
    "linear (no_grad)": (False, False, 1.0),
    "mm": (False, False, 1.0),
    "Tensor.mm (a.mm(b))": (False, False, 1.0),
    "softmax (fp32, no cast)": (False, False, 1.0),
    "cat (one dtype, no cast)": (False, False, 1.0),
}
MODES = ("bare", "autocast", "floor", "hmp")

# The floor's pieces, torch's own (captured before any convert())
_F32, _BF16, _HALVES = torch.float32, torch.bfloat16, (torch.bfloat16, torch.float16)
_bf16, _float = torch.Tensor.bfloat16, torch.Tensor.float
_floor_down = floor_module.down  # an activation's cast, as benchmarks/floor.py makes it


def floor(op, case):
    """The floor's wrapper of ``op`` for ``case``: a new one per sample, with its own dict cache."""
    weights = {}
    if case.startswith("linear"):

        def linear(input, weight, bias=None):
            if input.dtype is _F32:
                input = _floor_down(input)
            w = weights.get(id(weight))
            if w is None:  # a weight in range (checked on the cast): as hmp's first call, saturating
                w = weights[id(weight)] = _bf16(weight)
            b = weights.get(id(bias))
            if b is None and bias is not None:
                b = weights[id(bias)] = _bf16(bias)
            return op(input, w, b)

        return linear
    if case == "mm" or case.startswith("Tensor.mm"):

        def mm(a, b):
            if a.dtype is _F32:
                a = _floor_down(a)
            if b.dtype is _F32:
                b = _floor_down(b)
            return op(a, b)

        return mm
    if case.startswith("softmax"):

        def softmax(input, dim, dtype=None):
            if input.dtype in _HALVES:
                input = _float(input)
            return op(input, dim) if dtype is None else op(input, dim, dtype)

        return softmax
    if case.startswith("cat"):

        def cat(tensors, dim=0):
            first = tensors[0].dtype
            for t in tensors:
                if t.dtype is not first:  # not timed: the floor's promote rule
                    dt = torch.result_type(*tensors)
                    tensors = [x.to(dt) for x in tensors]
                    break
            return op(tensors, dim)

        return cat
    raise AssertionError(case)


def cases(device="cpu"):
    """case -> (namespace, attribute, the call, made through the site)."""
    torch.manual_seed(0)
    x, a, b = (torch.randn(SIZE, SIZE, device=device) for _ in range(3))
    # an activation inside a training forward: an op's output, not a leaf (hmp's cache keeps a leaf that
    # requires grad as a weight, which an activation never is)
    with torch.enable_grad():
        h = torch.randn(SIZE, SIZE, device=device, requires_grad=True) * 1.0
    w = nn.Parameter(torch.randn(SIZE, SIZE, device=device))
    bias = nn.Parameter(torch.randn(SIZE, device=device))
    return {
        "linear (training)": (F, "linear", lambda: F.linear(h, w, bias)),
        "linear (frozen_weights)": (F, "linear", lambda: F.linear(x, w, bias)),
        "linear (no_grad)": (F, "linear", lambda: F.linear(x, w, bias)),
        "mm": (torch, "mm", lambda: torch.mm(a, b)),
        "Tensor.mm (a.mm(b))": (torch.Tensor, "mm", lambda: a.mm(b)),
        "softmax (fp32, no cast)": (torch, "softmax", lambda: torch.softmax(x, -1)),
        "cat (one dtype, no cast)": (torch, "cat", lambda: torch.cat([a, b])),
    }


def implementations(table, originals):
    """case -> {mode: what the site holds in that mode, or a factory of it (the floor)}; hmp converted."""
    return {
        case: {
            "bare": originals[case],
            "autocast": originals[case],
            "floor": lambda case=case: floor(originals[case], case),
            "hmp": getattr(ns, attr),
        }
        for case, (ns, attr, _) in table.items()
    }


@contextlib.contextmanager
def installed(ns, attr, impl):
    before = getattr(ns, attr)
    setattr(ns, attr, impl)
    try:
        yield
    finally:
        setattr(ns, attr, before)


@contextlib.contextmanager
def mode_context(mode, case, device="cpu"):
    """One sample's region: grad mode as the case says (inference: a ``torch.no_grad()`` block, as a
    model's evaluation is), autocast's region, hmp's ``frozen_weights()`` where the case asks for it."""
    grad, frozen, _ = CASES[case]
    with contextlib.ExitStack() as stack:
        if mode == "hmp" and frozen:
            stack.enter_context(hmp.frozen_weights())
        stack.enter_context(contextlib.nullcontext() if grad else torch.no_grad())
        if mode == "autocast":
            stack.enter_context(torch.autocast(torch.device(device).type, dtype=torch.bfloat16))
        yield


def sync(device):
    """Wait for queued kernels: on CUDA the loop measures what the host adds
    per launch, and the kernels of 8x8 tensors finish inside it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def sample(fn, calls, device="cpu"):
    keep = fn()  # in training, a live graph holding the weight's cast copy
    seconds = per_call(fn, calls, functools.partial(sync, device))
    del keep
    return seconds * 1e6


def _impl(impls, case, mode):
    impl = impls[case][mode]
    return impl() if mode == "floor" else impl


def run(reps, calls, progress=print, device="cpu"):
    table = cases(device)
    originals = {c: getattr(ns, attr) for c, (ns, attr, _) in table.items()}
    hmp.convert()
    try:
        impls = implementations(table, originals)
        samples = {c: {m: [] for m in MODES} for c in table}
        dtypes = {}
        for case, (ns, attr, fn) in table.items():  # warm-up, and what each mode returns
            for mode in MODES:
                with installed(ns, attr, _impl(impls, case, mode)), mode_context(mode, case, device):
                    for _ in range(200):
                        out = fn()
                dtypes.setdefault(case, {})[mode] = str(out.dtype).replace("torch.", "")
        for rep in range(reps):
            for case, (ns, attr, fn) in table.items():
                for mode in rotated(MODES, rep):
                    gc.collect()
                    with installed(ns, attr, _impl(impls, case, mode)), mode_context(mode, case, device):
                        samples[case][mode].append(sample(fn, calls, device))
            progress(f"rep {rep + 1}/{reps}")
    finally:
        hmp.revert()
    launches = kernels()
    result = {}
    for case, per_mode in samples.items():
        med = {m: statistics.median(v) for m, v in per_mode.items()}
        # what a mode adds: per rep, against that rep's bare sample (load drifts slowly next to a rep)
        paired = {m: [s - b for s, b in zip(v, per_mode["bare"])] for m, v in per_mode.items() if m != "bare"}
        over_floor = [s - f for s, f in zip(per_mode["hmp"], per_mode["floor"])]
        limit = CASES[case][2]
        result[case] = {
            "kernels_per_call": launches[case],
            "median_us": med,
            "added_us": {m: statistics.median(v) for m, v in paired.items()},
            "added_quartiles_us": {m: quartiles(v) for m, v in paired.items()},
            "hmp_over_floor_us": statistics.median(over_floor),
            "hmp_over_floor_quartiles_us": quartiles(over_floor),
            "dtype": dtypes[case],
            "limit_over_floor_us": limit,
            "met": statistics.median(over_floor) <= limit,
        }
    return result


def kernels():
    """case -> mode -> kernel launches per call on a GPU, counted (hmp.tools.launches) where nothing
    runs: bare, the floor and hmp on ``meta`` tensors (their off-CPU paths, as on CUDA), autocast on
    CPU tensors (its region's policy for these ops is the CUDA one). The third call in one region:
    what a weight cache keeps is not cast again."""
    tables = {"meta": cases("meta"), "cpu": cases("cpu")}
    originals = {c: getattr(ns, attr) for c, (ns, attr, _) in tables["cpu"].items()}
    out = {c: {} for c in originals}
    hmp.convert()
    try:
        impls = implementations(tables["cpu"], originals)
        for case in originals:
            for mode in MODES:
                device = "cpu" if mode == "autocast" else "meta"
                ns, attr, fn = tables[device][case]
                with installed(ns, attr, _impl(impls, case, mode)), mode_context(mode, case, device):
                    keep = fn(), fn()  # a region keeps a weight's copy from its second use
                    out[case][mode] = count(fn).kernels
                    del keep
    finally:
        hmp.revert()
    return out


def report(result):
    lines = [
        "| call | bare (us) | autocast added | floor added | hmp added | hmp - floor (IQR) | target | met "
        "| GPU kernels per call: bare / autocast / floor / hmp |",
        "|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for case, r in result.items():
        a, q = r["added_us"], r["hmp_over_floor_quartiles_us"]
        lines.append(
            f"| {case} | {r['median_us']['bare']:.2f} | {a['autocast']:+.2f} | {a['floor']:+.2f} | {a['hmp']:+.2f} | "
            f"{r['hmp_over_floor_us']:+.2f} ({q[0]:+.2f} to {q[1]:+.2f}) | <= +{r['limit_over_floor_us']:g} | "
            f"{'yes' if r['met'] else 'no'} | {' / '.join(str(r['kernels_per_call'][m]) for m in MODES)} |"
        )
    return "\n".join(lines)


def _repeat(fn, calls):
    for _ in range(calls):
        fn()


def profile(calls, device="cpu", top=12):
    """cProfile of ``calls`` calls of each case through hmp's wrapper, in its sample's region: the
    functions by own time per call (cProfile's own cost inflates Python: read the shares)."""
    table = cases(device)
    out = []
    with hmp.converted():
        for case, (_, _, fn) in table.items():
            with mode_context("hmp", case, device):
                keep = fn()
                prof = cProfile.Profile()
                prof.runcall(_repeat, fn, calls)
                del keep
            stats = pstats.Stats(prof).stats
            rows = sorted(((v[2], v[1], f"{Path(k[0]).name}:{k[2]}") for k, v in stats.items()), reverse=True)
            total = sum(v[2] for v in stats.values()) / calls * 1e6
            out += [f"{case}: {total:.2f} us per call under cProfile", "| function | calls/call | own us/call |"]
            out += ["|---|---:|---:|"]
            out += [f"| {name} | {n / calls:.0f} | {tt / calls * 1e6:.2f} |" for tt, n, name in rows[:top]]
            out.append("")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=61)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--profile", action="store_true", help="cProfile hmp's calls instead of timing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="hmp: a torch.autocast region")  # entered on purpose, per sample
    if args.profile:
        print(profile(args.calls * 10, args.device))
        return
    bar = Progress("timing", args.reps, "percall.py", unit="rep")  # one line (a bar on a terminal), not one per rep
    result = run(args.reps, args.calls, progress=lambda said: bar.step(), device=args.device)  # the bar counts reps
    bar.close()
    print(
        f"torch {torch.__version__}, {SIZE}x{SIZE} tensors on {args.device}, median over {args.reps} reps of "
        f"interleaved samples of {args.calls} calls less that rep's bare one (hmp - floor: less that rep's "
        f"floor one; IQR its quartiles), one thread"
    )
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


# its quickest run that still goes through its code (tests/integration/test_benchmark_scripts.py)
QUICK = ("--reps", "1", "--calls", "10")


if __name__ == "__main__":
    main()
