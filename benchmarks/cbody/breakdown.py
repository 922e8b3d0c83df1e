"""Where the µs of a cast call go, on 8x8 tensors (the bench's mm case): what
a C wrapper body can remove and what it cannot (the casts stay Python and
their kernels stay). Medians of interleaved samples, one thread.

    python benchmarks/cbody/breakdown.py [--reps 31] [--calls 2000]
"""

import argparse
import gc
import statistics
import sys
import time

import torch
import torch.nn as nn

import hmp
from hmp.core import cache, policy, state

SIZE = 8


def parts():
    torch.manual_seed(0)
    a, b = torch.randn(SIZE, SIZE), torch.randn(SIZE, SIZE)
    a16, b16 = a.bfloat16(), b.bfloat16()
    w = nn.Parameter(torch.randn(SIZE, SIZE))
    mm, to_bf16 = torch._C._VariableFunctions.mm, torch._C.TensorBase.bfloat16
    finite, cached = policy.CASTS[torch.bfloat16], cache.caster(torch.bfloat16)
    tls = state.tls
    nan_to_num_, top = torch._C.TensorBase.nan_to_num_, torch.finfo(torch.bfloat16).max
    y = a16.clone()

    def frozen_hit():
        return cached(w)

    def off_get_set():
        if not tls.off:
            tls.off = 1
            tls.off = 0

    return {
        "mm fp32 (bare)": lambda: mm(a, b),
        "mm bf16 (inputs cast beforehand)": lambda: mm(a16, b16),
        "TensorBase.bfloat16(a) (a plain cast, one kernel)": lambda: to_bf16(a),
        "TensorBase.nan_to_num_(y) (cast_finite's second kernel)": lambda: nan_to_num_(y, float("nan"), top, -top),
        "policy.CASTS[bf16](a) (cast_finite: cast + nan_to_num_)": lambda: finite(a),
        "cache.caster(bf16)(a) (an activation: -> cast_finite)": lambda: cached(a),
        "cache.caster(bf16)(w) in frozen_weights (a hit)": frozen_hit,
        "tls.off read + 2 writes (the body's state)": off_get_set,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=31)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    table = parts()
    samples = {k: [] for k in table}
    with torch.no_grad(), hmp.frozen_weights():
        for fn in table.values():
            for _ in range(200):
                fn()
        for _ in range(args.reps):
            for name, fn in table.items():
                gc.collect()
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                samples[name].append((time.perf_counter() - start) / args.calls * 1e6)
    print(f"torch {torch.__version__}, {SIZE}x{SIZE} cpu, medians of {args.reps} samples of {args.calls} calls")
    print("| part | us per call |\n|---|---:|")
    for name, v in samples.items():
        print(f"| {name} | {statistics.median(v):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
