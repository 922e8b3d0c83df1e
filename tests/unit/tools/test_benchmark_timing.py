"""Every benchmark script times through hmp.tools.timing (per_call, interleaved, Stopwatch): one
way of taking samples, so a change to it (a device synchronisation, the rounds' order) reaches every
table. A clock read in a script is the sign of a timing loop of its own."""

import ast
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time_ns", "process_time"}


def clock_reads(source):
    """``[(line, what)]`` of every read of a clock in ``source``: time.perf_counter and its kin,
    time.time, and any of them imported from ``time``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and (
            node.attr in CLOCKS or (node.attr == "time" and getattr(node.value, "id", None) == "time")
        ):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and node.module == "time":
            found += [(node.lineno, f"from time import {a.name}") for a in node.names if a.name in CLOCKS | {"time"}]
    return found


SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def test_the_benchmarks_are_found():
    assert {"run.py", "decode.py", "gpu.py", "percall.py"} <= {p.name for p in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_no_benchmark_reads_a_clock_of_its_own(script):
    assert clock_reads(script.read_text()) == [], f"{script.name}: time it with hmp.tools.timing"


@pytest.mark.parametrize(
    "line",
    [
        "t0 = time.perf_counter()",
        "t0 = time.time()",
        "t0 = time.monotonic()",
        "from time import perf_counter",
        "from time import time as now",
        "import time as t; t.perf_counter_ns()",
    ],
)
def test_a_planted_clock_is_caught(line):
    assert clock_reads(f"import time\n{line}\n")


def test_dates_and_timeit_are_not_clock_reads():
    # a run's date in its metadata, and timeit's statement timings below a function call's cost
    assert clock_reads("import time, timeit\nwhen = time.strftime('%Y')\ntimeit.timeit('pass')\n") == []
