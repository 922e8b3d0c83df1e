"""Reference leaks of the C body: each path called N and 2N times; the
process's live objects and RSS must not grow with N.

    python benchmarks/cbody/leaks.py
"""

import gc
import os
import sys
import warnings

import torch
import torch.nn.functional as F

import hmp
from hmp.core import policy, wrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402


def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def main():
    torch.set_num_threads(1)
    x, a, b, h, w, bias = bench.tensors()
    hmp.convert()
    try:
        low, casters = torch.bfloat16, hmp.core.cache.casters()

        def site(op, name):
            return wrap.make(
                op,
                policy.lower(low, casters, None, name),
                None,
                src=policy.FP32_ONLY,
                cast=casters[low],
                refuse=policy.numbers_check(low, name),
                hidden=True,
            )

        def boom(t):
            raise ValueError("boom")

        def scale(t, s):
            return t * s

        geqrf = bench.c_wrapper(site(torch._C._VariableFunctions.geqrf, "geqrf"))
        paths = {
            "cast (mm)": (bench.c_wrapper(torch.mm), (a, b), {}),
            "no cast (softmax)": (bench.c_wrapper(torch.softmax), (x, -1), {}),
            "promote, list (cat)": (bench.c_wrapper(torch.cat), ([a, b],), {}),
            "promote mixed -> prepare": (bench.c_wrapper(torch.cat), ([a, b.bfloat16()],), {}),
            "keywords -> prepare": (bench.c_wrapper(F.linear), (x, w), {"bias": bias}),
            "refuse -> prepare": (bench.c_wrapper(site(scale, "scale")), (x, 1e39), {}),
            "decay -> Python cast_seq": (bench.c_wrapper(site(scale, "mul")), (x, 0.995), {}),
            "op raises": (bench.c_wrapper(site(boom, "boom")), (x,), {}),
            "rescue (geqrf)": (geqrf, (x,), {}),
        }
        print("| path | objects after N / 2N calls | RSS KiB after N / 2N |\n|---|---|---|")
        for name, (fn, args, kwargs) in paths.items():
            counts = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for n in (50000, 50000, 50000):
                    for _ in range(n):
                        try:
                            fn(*args, **kwargs)
                        except ValueError:
                            pass
                    gc.collect()
                    counts.append((len(gc.get_objects()), rss_kib()))
            (_, _), (o1, r1), (o2, r2) = counts
            print(f"| {name} | {o1} / {o2} | {r1} / {r2} |")
    finally:
        hmp.revert()
    return 0


if __name__ == "__main__":
    sys.exit(main())
