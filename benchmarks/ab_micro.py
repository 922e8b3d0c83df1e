"""Per-call cost of this checkout's wrappers against another checkout's, in one process.

    python benchmarks/ab_micro.py /path/to/other/checkout [--pairs 80]

Both packages are loaded side by side (the other one as ``hmp_other``) and
both are converted with their default O1 lists: the other first, then this
one, so each holds live wrappers of the same torch ops calling the same
originals. Each pair of samples times ``--calls`` calls of one wrapper and
then of the other (the order alternates), and the ratio of the pair is kept:
load on the machine changes slowly next to a pair, so it cancels out of the
ratio. Prints the median ratio (this / other; below 1: this is faster) and
its interquartile range per op: F.linear with nn.Parameter weights (cast
through the weight cache), torch.mul (BF16 list), torch.cat (promote list),
and ``Tensor.__add__`` (promote list, no cast).
"""

import argparse
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
    spec = importlib.util.spec_from_file_location(name, checkout / "hmp" / "__init__.py",
                                                  submodule_search_locations=[str(checkout / "hmp")])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def wrappers():
    return {"linear": F.linear, "mul": torch.mul, "cat": torch.cat, "add": torch.Tensor.__add__}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other", type=Path, help="the checkout to compare with (a git worktree of another commit)")
    ap.add_argument("--pairs", type=int, default=80)
    ap.add_argument("--calls", type=int, default=1000, help="calls per sample")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    other = load("hmp_other", args.other.resolve())
    this = load("hmp", HERE.parent)
    other.convert()
    theirs = wrappers()
    this.convert()
    ours = wrappers()
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    w, bias = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8))
    calls = {"linear": lambda f: f(a, w, bias), "mul": lambda f: f(a, b), "cat": lambda f: f([a, b]),
             "add": lambda f: f(a, b)}
    gc.disable()
    print(f"per-call time, this / other ({args.pairs} interleaved pairs of {args.calls} calls)\n")
    print("| op | median | interquartile range |")
    print("|---|---:|---|")
    for op, call in calls.items():
        ratios = []
        for i in range(args.pairs):
            order = [("this", ours[op]), ("other", theirs[op])]
            times = {name: timeit.timeit(lambda: call(fn), number=args.calls) for name, fn in order[::1 - 2 * (i % 2)]}
            ratios.append(times["this"] / times["other"])
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(f"| {op} | {statistics.median(ratios):.3f} | {q1:.3f} - {q3:.3f} |")


if __name__ == "__main__":
    main()
