"""Per-call overhead of two checkouts of hmp, measured interleaved.

    python benchmarks/ab_micro.py /path/to/other/checkout [--rounds 8]

Each round runs ``micro.run`` (benchmarks/micro.py) once in a fresh process
per checkout, alternating which goes first, and keeps hmp O1's overhead per
op over plain torch measured in that same process, ``(hmp - plain)``, so a
change in the machine's load between processes cancels out of each number.
Prints the median overhead per op for each checkout and their ratio
(``this / other``: below 1 means this checkout is faster).
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, sys
sys.path[:0] = [sys.argv[1] + "/benchmarks", sys.argv[1]]
import torch
import micro
res = micro.run("cpu", int(sys.argv[2]), int(sys.argv[3]), lambda: None, progress=lambda *a: None)
print(json.dumps({op: r["median_us"]["hmp-O1"] - r["median_us"]["plain"] for op, r in res["ops"].items()}))
"""


def overhead(checkout, reps, calls):
    out = subprocess.run([sys.executable, "-c", CHILD, str(checkout), str(reps), str(calls)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other", type=Path, help="the checkout to compare with (a git worktree of another commit)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5, help="samples per mode inside one process")
    ap.add_argument("--calls", type=int, default=2000, help="calls per sample")
    args = ap.parse_args(argv)
    checkouts = {"this": HERE.parent, "other": args.other.resolve()}
    samples = {name: [] for name in checkouts}
    for r in range(args.rounds):
        order = list(checkouts) if r % 2 == 0 else list(reversed(checkouts))
        for name in order:
            samples[name].append(overhead(checkouts[name], args.reps, args.calls))
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    ops = list(samples["this"][0])
    print(f"hmp O1 per-call overhead over plain torch, us (median of {args.rounds} processes)\n")
    print("| op | this | other | this / other |")
    print("|---|---:|---:|---:|")
    for op in ops:
        this, other = (statistics.median(s[op] for s in samples[name]) for name in ("this", "other"))
        print(f"| {op} | {this:.2f} | {other:.2f} | {this / other:.3f} |")
    total = [sum(s.values()) for s in samples["this"]], [sum(s.values()) for s in samples["other"]]
    this, other = statistics.median(total[0]), statistics.median(total[1])
    print(f"| sum | {this:.2f} | {other:.2f} | {this / other:.3f} |")


if __name__ == "__main__":
    main()
