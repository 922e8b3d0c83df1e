"""The suite's own rules, from tests/conftest.py, run in a small pytest
session of their own: a default run skips the tests marked slow and says how
to run them; a test that leaves hmp.disable_casts() active is reported as a
failure of that test (not an error elsewhere), and the next test starts with
casting on."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

SUITE = """
import pytest

import hmp


@pytest.mark.slow
def test_slow():
    pass


def test_fast():
    pass


def test_leaks():
    hmp.disable_casts().__enter__()


def test_after():
    assert hmp.casts_enabled()
"""


@pytest.fixture
def suite(pytester):
    pytester.makeconftest(Path(__file__).parents[1].joinpath("conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    pytester.makepyfile(test_some=SUITE)
    return pytester


def test_slow_tests_run_only_with_run_slow(suite):
    default = suite.runpytest_inprocess("-rs", "-k", "slow or fast")
    default.assert_outcomes(passed=1, skipped=1)
    default.stdout.fnmatch_lines(["SKIPPED*test_some.py*slow; run all tests with: python -m pytest --run-slow"])
    suite.runpytest_inprocess("--run-slow", "-k", "slow or fast").assert_outcomes(passed=2)


def test_a_leaked_disable_casts_fails_the_test_that_leaked_it(suite):
    result = suite.runpytest_inprocess("-rf", "-k", "leaks or after")
    result.assert_outcomes(passed=1, failed=1, errors=0)
    result.stdout.fnmatch_lines(
        [
            "the test left hmp.disable_casts() active (casts are still off when it returned)",
            "FAILED test_some.py::test_leaks - Failed: the test left hmp.disable_casts()*",
        ]
    )
