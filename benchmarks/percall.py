"""Microseconds each mixed-precision scheme adds to one call, against bare torch.

    python benchmarks/percall.py [--reps 31] [--calls 2000] [--device cpu] [--json out.json]

The table of the per-call issue: ``F.linear`` in a training forward and in
inference, ``torch.mm`` of two activations, ``torch.softmax`` of float32 (FP32
list, nothing to cast) and ``torch.cat`` of one dtype (promote list, nothing
to cast), on 8x8 tensors, so the numbers are the schemes' overhead, not the
kernels'.

hmp is converted once for the whole run; bare torch and torch.autocast call
the originals captured before ``convert()``, so the three modes interleave
sample by sample in one process without switching anything. Weight casts are
reused by both schemes as each allows: in training (an input that requires
grad, as inside a model) hmp's cache reuses a copy while a live graph saves it
(one output is kept alive) and autocast's region caches it; in inference hmp runs inside
``hmp.frozen_weights()`` and autocast
inside one region. Reports medians and the targets of the per-call issue:
within +1.0 us of autocast's added time for linear and mm, within +0.4 us of
bare torch for calls with nothing to cast.
"""

import argparse
import contextlib
import gc
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import hmp

SIZE = 8
MODES = ("bare", "autocast", "hmp")
# case -> (target kind, limit in us): "vs autocast" compares with autocast's added time
TARGETS = {
    "linear (training)": ("vs autocast", 1.0),
    "linear (inference)": ("vs autocast", 1.0),
    "mm": ("vs autocast", 1.0),
    "softmax (fp32, no cast)": ("vs bare", 0.4),
    "cat (one dtype, no cast)": ("vs bare", 0.4),
}


def cases(device="cpu"):
    """case -> (grad enabled, {mode: callable}); hmp must not be converted yet."""
    torch.manual_seed(0)
    x, a, b = (torch.randn(SIZE, SIZE, device=device) for _ in range(3))
    h = torch.randn(SIZE, SIZE, device=device, requires_grad=True)  # an activation inside a training forward
    w = nn.Parameter(torch.randn(SIZE, SIZE, device=device))
    bias = nn.Parameter(torch.randn(SIZE, device=device))
    linear, mm, softmax, cat = F.linear, torch.mm, torch.softmax, torch.cat  # the originals

    def both(orig, patched):
        return {"bare": orig, "autocast": orig, "hmp": patched}

    return {
        "linear (training)": (True, both(lambda: linear(h, w, bias), lambda: F.linear(h, w, bias))),
        "linear (inference)": (False, both(lambda: linear(x, w, bias), lambda: F.linear(x, w, bias))),
        "mm": (False, both(lambda: mm(a, b), lambda: torch.mm(a, b))),
        "softmax (fp32, no cast)": (False, both(lambda: softmax(x, -1), lambda: torch.softmax(x, -1))),
        "cat (one dtype, no cast)": (False, both(lambda: cat([a, b]), lambda: torch.cat([a, b]))),
    }


@contextlib.contextmanager
def mode_context(mode, grad, device="cpu"):
    with torch.set_grad_enabled(grad), contextlib.ExitStack() as stack:
        if mode == "autocast":
            stack.enter_context(torch.autocast(torch.device(device).type, dtype=torch.bfloat16))
        elif mode == "hmp" and not grad:
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
    hmp.convert()
    try:
        samples = {c: {m: [] for m in MODES} for c in table}
        dtypes = {}
        for case, (grad, fns) in table.items():  # warm-up, and what each mode returns
            for mode, fn in fns.items():
                with mode_context(mode, grad, device):
                    for _ in range(200):
                        out = fn()
                dtypes.setdefault(case, {})[mode] = str(out.dtype).replace("torch.", "")
        for rep in range(reps):
            for case, (grad, fns) in table.items():
                for mode, fn in fns.items():
                    gc.collect()
                    with mode_context(mode, grad, device):
                        samples[case][mode].append(sample(fn, calls, device))
            progress(f"  rep {rep + 1}/{reps}")
    finally:
        hmp.revert()
    result = {}
    for case, per_mode in samples.items():
        med = {m: statistics.median(v) for m, v in per_mode.items()}
        added = {m: med[m] - med["bare"] for m in ("autocast", "hmp")}
        kind, limit = TARGETS[case]
        over = added["hmp"] - (added["autocast"] if kind == "vs autocast" else 0.0)
        result[case] = {
            "median_us": med,
            "added_us": added,
            "dtype": dtypes[case],
            "target": kind,
            "limit_us": limit,
            "over_us": over,
            "met": over <= limit,
        }
    return result


def report(result):
    lines = [
        "| call | hmp added (us) | autocast added (us) | target | hmp over it (us) | met |",
        "|---|---:|---:|---|---:|---|",
    ]
    for case, r in result.items():
        lines.append(
            f"| {case} | {r['added_us']['hmp']:+.2f} | {r['added_us']['autocast']:+.2f} | "
            f"{r['target']} <= +{r['limit_us']:.1f} | {r['over_us']:+.2f} | "
            f"{'yes' if r['met'] else 'no'} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=31)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = run(args.reps, args.calls, device=args.device)
    print(
        f"torch {torch.__version__}, {SIZE}x{SIZE} tensors on {args.device}, medians of {args.reps} "
        f"interleaved samples of {args.calls} calls, one thread"
    )
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
