"""convert()'s own time: resolving each list name once (one Resolver shared
by checking the lists and binding them) against resolving them twice (the
lists checked with one Resolver, bound with another, as convert() did before
issue 32's review).

Interleaved, medians, ratios within this process; prints a small table.
``python benchmarks/convert_time.py [--rounds N]``
"""

import argparse
import statistics
import time

import hmp
from hmp.binding.resolve import Resolver
from hmp.driver import conversion
from hmp.driver.plan import plan


def once():
    start = time.perf_counter()
    hmp.convert()
    took = time.perf_counter() - start
    hmp.revert()
    return took


def twice():
    start = time.perf_counter()
    with conversion.runtime.lock:
        wanted = plan({}, Resolver())
        conversion.apply(wanted, Resolver())
    took = time.perf_counter() - start
    hmp.revert()
    return took


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    once(), twice()  # warm: torch's lazy imports, the list files' caches
    times = {"once": [], "twice": []}
    for i in range(args.rounds):
        for name, fn in (("once", once), ("twice", twice))[:: 1 - 2 * (i % 2)]:
            times[name].append(fn())
    median = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print("| convert() | median ms |")
    print("|---|---:|")
    print(f"| names resolved twice (before) | {median['twice']:.1f} |")
    print(f"| names resolved once (now) | {median['once']:.1f} |")
    print(f"\nonce / twice: {median['once'] / median['twice']:.2f}")


# its quickest run that still goes through its code (tests/integration/test_benchmark_scripts.py)
QUICK = ("--rounds", "1")


if __name__ == "__main__":
    main()
