"""convert()'s own time: resolving each list name once (one Resolver shared
by checking the lists and binding them) against resolving them twice (the
lists checked with one Resolver, bound with another, as convert() did before
issue 32's review).

Interleaved, medians, ratios within this process; prints a small table.
``python benchmarks/convert_time.py [--rounds N]``
"""

import argparse
import statistics

import hmp
from hmp.binding.resolve import Resolver
from hmp.driver import conversion
from hmp.driver.plan import Requested, plan
from hmp.tools.timing import interleaved, per_call


def once():
    took = per_call(hmp.convert)
    hmp.revert()
    return took


def _resolve_twice():
    with conversion.runtime.lock:
        wanted = plan(Requested(), Resolver())
        conversion.apply(wanted, Resolver())


def twice():
    took = per_call(_resolve_twice)
    hmp.revert()
    return took


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    # the warm-up round: torch's lazy imports, the list files' caches; then once, twice / twice, once / ...
    times = interleaved({"once": once, "twice": twice}, args.rounds, warmup=1)
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
