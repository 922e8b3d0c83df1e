"""Per-call cost of this checkout's wrappers against another checkout's, in one process.

    python benchmarks/ab_micro.py /path/to/other/checkout [--pairs 80]

Both packages are loaded side by side (the other one as ``hmp_other``) and
both are converted with their default O1 lists: the other first, then this
one, so each holds live wrappers of the same torch ops calling the same
originals. Each pair of samples times ``--calls`` calls of one wrapper and
then of the other (the order alternates), and the ratio of the pair is kept:
load on the machine changes slowly next to a pair, so it cancels out of the
ratio. Prints the median ratio (this / other; below 1: this is faster) and
its interquartile range per case, on 8x8 tensors: the cases of
benchmarks/percall.py (F.linear in training with a live graph, F.linear in
inference inside each package's ``frozen_weights()``, torch.mm,
torch.softmax and torch.cat with nothing to cast), plus ``Tensor.__add__``
(promote list, no cast), ``Tensor.__mul__`` by a number (BF16 list) and
F.linear with grad on and no graph kept (each weight's first use in a
training step: a cache miss).
"""

import argparse
import contextlib
import gc
import importlib.util
import statistics
import sys
import timeit
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


def load(name, checkout):
    spec = importlib.util.spec_from_file_location(
        name, checkout / "hmp" / "__init__.py", submodule_search_locations=[str(checkout / "hmp")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def wrappers():
    return {
        "linear": F.linear,
        "mm": torch.mm,
        "softmax": torch.softmax,
        "cat": torch.cat,
        "add": torch.Tensor.__add__,
        "mul": torch.Tensor.__mul__,
    }


def cases():
    """case -> (grad enabled, op, call, inside frozen_weights())"""
    torch.manual_seed(0)
    x, a, b = (torch.randn(8, 8) for _ in range(3))
    h = torch.randn(8, 8, requires_grad=True)
    w, bias = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8))
    return {
        "linear (training, live graph)": (True, "linear", lambda f: f(h, w, bias), False),
        "linear (inference, frozen_weights)": (False, "linear", lambda f: f(x, w, bias), True),
        "mm": (False, "mm", lambda f: f(a, b), False),
        "softmax (nothing to cast)": (False, "softmax", lambda f: f(x, -1), False),
        "cat (nothing to cast)": (False, "cat", lambda f: f([a, b]), False),
        "add (nothing to cast)": (False, "add", lambda f: f(a, b), False),
        "mul by a number": (False, "mul", lambda f: f(a, 0.5), False),
        "linear (grad, no graph kept: cache misses)": (True, "linear", lambda f: f(x, w, bias), False),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other", type=Path, help="the checkout to compare with (a git worktree of another commit)")
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--calls", type=int, default=500, help="calls per sample")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    other = load("hmp_other", args.other.resolve())
    this = load("hmp", HERE.parent)
    other.convert()
    theirs = wrappers()
    this.convert()
    ours = wrappers()
    gc.disable()
    print(f"per-call time, this / other ({args.pairs} interleaved pairs of {args.calls} calls, one thread)\n")
    print("| case | median | interquartile range | other, us per call |")
    print("|---|---:|---|---:|")
    for case, (grad, op, call, frozen) in cases().items():
        ratios, other_us = [], []
        with torch.set_grad_enabled(grad):
            keep = call(ours[op]), call(theirs[op])  # training: a live graph holds each cache's copies
            for i in range(args.pairs):
                order = [("this", ours[op], this), ("other", theirs[op], other)]
                times = {}
                for name, fn, package in order[:: 1 - 2 * (i % 2)]:
                    with package.frozen_weights() if frozen else contextlib.nullcontext():
                        times[name] = timeit.timeit(lambda fn=fn, call=call: call(fn), number=args.calls)
                ratios.append(times["this"] / times["other"])
                other_us.append(times["other"] / args.calls * 1e6)
            del keep
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(f"| {case} | {statistics.median(ratios):.3f} | {q1:.3f} - {q3:.3f} | {statistics.median(other_us):.2f} |")


# its quickest run that still goes through its code (tests/integration/test_benchmark_scripts.py)
QUICK = (".", "--pairs", "2", "--calls", "10")  # this checkout against itself


if __name__ == "__main__":
    main()
