"""Microseconds each mixed-precision scheme adds to one call, against bare torch.

    python benchmarks/percall.py [--reps 61] [--calls 1000] [--device cpu] [--json out.json]

The table of the per-call issues: ``F.linear`` in a training forward and in
inference, ``torch.mm`` and ``a.mm(b)`` (a Tensor method) of two
activations, ``torch.softmax`` of float32 (FP32 list: nothing to cast) and
``torch.cat`` of one dtype (promote list: nothing to cast), on 8x8 tensors,
so the numbers are the schemes' overhead, not the kernels'.

Every call goes through the site (``F.linear``, ``torch.mm``, ...) as a
model's does, and per sample the site holds one implementation: torch's own
(bare, and autocast, which adds its region) or hmp's wrapper. hmp is converted once; the modes
interleave sample by sample, their order rotated each rep, and what a mode
adds is the median over reps of its sample minus that rep's bare one. Weight casts are
reused by each scheme as it allows: in training (an input that requires
grad, as inside a model, one output kept alive) hmp's cache reuses a copy
while a live graph holds it and autocast's region caches it; in inference
hmp runs inside ``hmp.frozen_weights()`` and autocast inside one region.

Targets (the per-call issue): for linear and mm, hmp adds at most twice
what autocast adds; a call with nothing to cast adds at most 0.5 us.
"""

import argparse
import contextlib
import gc
import json
import statistics
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import hmp
from hmp.tools.progress import Progress

SIZE = 8
# case -> (target kind, limit): "x autocast" bounds hmp's added time by autocast's times the limit,
# "us over bare" by the limit in us
TARGETS = {
    "linear (training)": ("x autocast", 2.0),
    "linear (inference)": ("x autocast", 2.0),
    "mm": ("x autocast", 2.0),
    "Tensor.mm (a.mm(b))": ("x autocast", 2.0),
    "softmax (fp32, no cast)": ("us over bare", 0.5),
    "cat (one dtype, no cast)": ("us over bare", 0.5),
}


def cases(device="cpu"):
    """case -> (grad enabled, namespace, attribute, the call, made through the site)."""
    torch.manual_seed(0)
    x, a, b = (torch.randn(SIZE, SIZE, device=device) for _ in range(3))
    h = torch.randn(SIZE, SIZE, device=device, requires_grad=True)  # an activation inside a training forward
    w = nn.Parameter(torch.randn(SIZE, SIZE, device=device))
    bias = nn.Parameter(torch.randn(SIZE, device=device))
    return {
        "linear (training)": (True, F, "linear", lambda: F.linear(h, w, bias)),
        "linear (inference)": (False, F, "linear", lambda: F.linear(x, w, bias)),
        "mm": (False, torch, "mm", lambda: torch.mm(a, b)),
        "Tensor.mm (a.mm(b))": (False, torch.Tensor, "mm", lambda: a.mm(b)),
        "softmax (fp32, no cast)": (False, torch, "softmax", lambda: torch.softmax(x, -1)),
        "cat (one dtype, no cast)": (False, torch, "cat", lambda: torch.cat([a, b])),
    }


def implementations(table, originals):
    """case -> {mode: what the site holds in that mode}; hmp converted."""
    return {
        case: {"bare": originals[case], "autocast": originals[case], "hmp": getattr(ns, attr)}
        for case, (_, ns, attr, _) in table.items()
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
def mode_context(mode, grad, device="cpu"):
    with torch.set_grad_enabled(grad), contextlib.ExitStack() as stack:
        if mode == "autocast":
            stack.enter_context(torch.autocast(torch.device(device).type, dtype=torch.bfloat16))
        elif mode != "bare" and not grad:
            stack.enter_context(hmp.frozen_weights())
        yield


def sync(device):
    """Wait for queued kernels: on CUDA the loop measures what the host adds
    per launch, and the kernels of 8x8 tensors finish inside it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def sample(fn, calls, device="cpu"):
    keep = fn()  # in training, a live graph holding the weight's cast copy
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    elapsed = time.perf_counter() - start
    del keep
    return elapsed / calls * 1e6


def run(reps, calls, progress=print, device="cpu"):
    table = cases(device)
    originals = {c: getattr(ns, attr) for c, (_, ns, attr, _) in table.items()}
    hmp.convert()
    try:
        impls = implementations(table, originals)
        modes = list(next(iter(impls.values())))
        samples = {c: {m: [] for m in impls[c]} for c in table}
        dtypes = {}
        for case, (grad, ns, attr, fn) in table.items():  # warm-up, and what each mode returns
            for mode, impl in impls[case].items():
                with installed(ns, attr, impl), mode_context(mode, grad, device):
                    for _ in range(200):
                        out = fn()
                dtypes.setdefault(case, {})[mode] = str(out.dtype).replace("torch.", "")
        for rep in range(reps):
            for case, (grad, ns, attr, fn) in table.items():
                order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
                for mode in order:
                    gc.collect()
                    with installed(ns, attr, impls[case][mode]), mode_context(mode, grad, device):
                        samples[case][mode].append(sample(fn, calls, device))
            progress(f"rep {rep + 1}/{reps}")
    finally:
        hmp.revert()
    result = {}
    for case, per_mode in samples.items():
        med = {m: statistics.median(v) for m, v in per_mode.items()}
        # what a mode adds: per rep, against that rep's bare sample (load drifts slowly next to a rep)
        paired = {m: [s - b for s, b in zip(v, per_mode["bare"])] for m, v in per_mode.items() if m != "bare"}
        added = {m: statistics.median(v) for m, v in paired.items()}
        spread = {m: quartiles(v) for m, v in paired.items()}
        kind, limit = TARGETS[case]
        bound = limit * added["autocast"] if kind == "x autocast" else limit
        result[case] = {
            "median_us": med,
            "added_us": added,
            "added_quartiles_us": spread,
            "dtype": dtypes[case],
            "target": kind,
            "limit": limit,
            "bound_us": bound,
            "met": added["hmp"] <= bound,
        }
    return result


def quartiles(values):
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def report(result):
    lines = ["| call | bare (us) | autocast added | hmp added | target for hmp | met |", "|---|---:|---:|---:|---|---|"]
    for case, r in result.items():
        a = r["added_us"]
        target = (
            f"<= {r['limit']:g}x autocast (+{r['bound_us']:.2f})"
            if r["target"] == "x autocast"
            else (f"<= +{r['limit']:g} us")
        )
        lines.append(
            f"| {case} | {r['median_us']['bare']:.2f} | {a['autocast']:+.2f} | {a['hmp']:+.2f} | {target} | "
            f"{'yes' if r['met'] else 'no'} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=61)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="hmp: a torch.autocast region")  # entered on purpose, per sample
    bar = Progress("timing", args.reps, "percall.py", unit="rep")  # one line (a bar on a terminal), not one per rep
    result = run(args.reps, args.calls, progress=bar.step, device=args.device)
    bar.close()
    print(
        f"torch {torch.__version__}, {SIZE}x{SIZE} tensors on {args.device}, median over {args.reps} reps of "
        f"interleaved samples of {args.calls} calls less that rep's bare one, one thread"
    )
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
