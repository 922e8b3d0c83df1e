"""What each rule of docs/never-changes.md costs per call, in one process.

    python benchmarks/mechanisms.py [--pairs 40] [--calls 500]

Each case times two callables that differ only by one mechanism, interleaved
in pairs (the order alternates), and reports the median of the per-pair
differences in microseconds per call and their ratio:

* the saturating cast (a finite value stays finite) against torch's own cast,
  per tensor size, with and without autograd;
* the write-back check after a call that cast something (a written argument
  is the caller's tensor), on a Python-function op (``F.relu``): the wrapper
  with the check against the same wrapper without it;
* the fallback wrapper of an op in no list (no op fails because of a cast):
  ``torch.cdist`` of two float32 tensors through hmp's wrapper, which steps
  aside, against the unwrapped op;
* the number check (Python, numpy and other real numbers) on the arguments
  of a BF16-rule call, against the same scan without it.

The wrapper cases use hmp's internals (wrap.make) to build the "without"
side; they measure, they do not change hmp.
"""

import argparse
import gc
import statistics
import sys
import timeit
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hmp  # noqa: E402
from hmp.binding import wrapper_life as wrap  # noqa: E402
from hmp.core import cast_copies, dtypes, policy  # noqa: E402
from hmp.core.rescue import About  # noqa: E402
from hmp.tools.timing import quartiles  # noqa: E402


def pairs(a, b, n_pairs, calls):
    """(median us a - b per call, median ratio a / b, quartiles of the ratios) over interleaved pairs."""
    diffs, ratios = [], []
    for i in range(n_pairs):
        order = [("a", a), ("b", b)][:: 1 - 2 * (i % 2)]
        t = {name: timeit.timeit(fn, number=calls) for name, fn in order}
        diffs.append((t["a"] - t["b"]) / calls * 1e6)
        ratios.append(t["a"] / t["b"])
    return statistics.median(diffs), statistics.median(ratios), quartiles(ratios)


def cases():
    out = {}
    finite, plain = cast_copies.FINITE_CASTS[torch.bfloat16].any, cast_copies.ROUNDING_CASTS[torch.bfloat16].any
    for shape in [(8, 8), (64, 64), (256, 1024)]:
        x = torch.randn(*shape)
        out[f"saturating cast, {shape[0]}x{shape[1]}"] = (lambda x=x: finite(x), lambda x=x: plain(x))
        h = torch.randn(*shape, requires_grad=True)
        out[f"saturating cast with autograd, {shape[0]}x{shape[1]}"] = (lambda h=h: finite(h), lambda h=h: plain(h))

    relu = F.relu  # the Python function (hmp not converted yet)
    casters = dict(cast_copies.FINITE_CASTS)
    prepare = policy.lower(torch.bfloat16, casters, policy.inplace_out(casters))
    limit = cast_copies.overflow_limit(torch.bfloat16)
    kw = dict(src=dtypes.FP32_ONLY, cast=casters[torch.bfloat16], limit=limit)
    with_check = wrap.make(relu, prepare, About("relu"), hidden=True, **kw)
    without = wrap.make(relu, prepare, About("relu"), hidden=False, **kw)
    x = torch.randn(8, 8)
    out["write-back check, F.relu casting 8x8"] = (lambda: with_check(x), lambda: without(x))
    return out


def converted_cases():
    """Cases that need hmp converted: (name, a, b)."""
    cdist = torch.cdist  # the original, taken before convert()
    a, b = torch.randn(8, 4), torch.randn(6, 4)
    x = torch.randn(8, 8)
    hmp.convert()
    yield "fallback wrapper stepping aside, cdist 8x4", (lambda: torch.cdist(a, b), lambda: cdist(a, b))
    cast, limit = cast_copies.FINITE_CASTS[torch.bfloat16].any, cast_copies.overflow_limit(torch.bfloat16)
    y = cast(x)
    args = (y, 0.5, np.float32(0.5), None, True, "mean")  # nothing to cast: only the number check differs
    yield (
        "number check, 6 arguments (float, numpy, None, bool, str)",
        (
            lambda: policy.cast_seq(args, dtypes.FP32_ONLY, cast, limit),
            lambda: policy.cast_seq(args, dtypes.FP32_ONLY, cast),
        ),
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--calls", type=int, default=500)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    gc.disable()
    print(f"torch {torch.__version__}; {args.pairs} interleaved pairs of {args.calls} calls, one thread\n")
    print("| mechanism | added, us per call (median) | with / without (median) | interquartile range |")
    print("|---|---:|---:|---|")
    rows = list(cases().items())
    try:
        rows += list(converted_cases())
        for name, (a, b) in rows:
            a(), b()
            diff, ratio, (q1, q3) = pairs(a, b, args.pairs, args.calls)
            print(f"| {name} | {diff:+.2f} | {ratio:.3f} | {q1:.3f} - {q3:.3f} |")
    finally:
        hmp.revert()


# its quickest run that still goes through its code (tests/integration/test_benchmark_scripts.py)
QUICK = ("--pairs", "2", "--calls", "10")


if __name__ == "__main__":
    main()
