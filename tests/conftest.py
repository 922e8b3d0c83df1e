"""Fixtures and the suite's own rules; shared helpers live in the helpers package."""

import os

import pytest
import torch
from helpers import DEVICES, assert_same, snapshot
from hypothesis import HealthCheck, settings

import hmp
from hmp.core import state, torch_releases

RUN_SLOW = "--run-slow"

# Hypothesis: the suite's default is "ci": few examples, the same ones every run (derandomize), no
# per-example deadline and no too-slow health check, so a busy 2-core machine cannot fail a test
# that an idle one passes. `python -m pytest --hypothesis-profile=thorough` searches 20 times as
# many, at random. A test that names max_examples itself (its examples are costly) keeps its count.
settings.register_profile(
    "ci",
    max_examples=25,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough", max_examples=500, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci")  # --hypothesis-profile, when given, is loaded after this


def pytest_addoption(parser):
    parser.addoption(RUN_SLOW, action="store_true", help="also run the tests marked slow (CI runs them all)")


def pytest_collection_modifyitems(config, items):
    if config.getoption(RUN_SLOW):
        return
    skip = pytest.mark.skip(reason=f"slow; run all tests with: python -m pytest {RUN_SLOW}")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test that leaves disable_casts() active fails (FAILED, not an
    ERROR in some fixture's teardown); casting is turned back on so the
    tests after it start clean."""
    result = yield
    if not hmp.casts_enabled():
        st = state.tls
        st.frames.clear()
        st.off, st.lower_mode = 0, None
        pytest.fail("the test left hmp.disable_casts() active (casts are still off when it returned)", pytrace=False)
    return result


# Under pytest-xdist the workers share the machine's cores: torch's default of one intra-op thread per core
# leaves each worker's OpenMP threads waiting for cores the other worker holds (a demo training step at batch 1,
# measured beside CI's two workers: 0.09 s on one thread, 0.36-1.12 s on two). Each worker, and each process
# it starts, runs one intra-op thread unless OMP_NUM_THREADS is set.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


ENV_LIST_VARS = (
    "LOWER_LIST",
    "FP32_LIST",
    "PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST",
    "PT_HPU_AUTOCAST_FP32_OPS_LIST",
    "HMP_STRICT",
)


@pytest.fixture(autouse=True)
def _always_revert(monkeypatch):
    """No test leaks a conversion (or a disabled state) into the next one,
    and list files named in the caller's environment do not leak in."""
    for var in ENV_LIST_VARS:
        monkeypatch.delenv(var, raising=False)
    yield
    hmp.revert()


@pytest.fixture
def one_intra_op_thread():
    """Tiny models: intra-op threads only spin against each other (and
    against other processes on a 2-core machine); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fresh_dynamo():
    """torch.compile's caches emptied before and after: no graph compiled
    under another test's conversion is reused."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# every engine, unless HMP_TEST_ENGINES names some (python or autocast: to run one engine's half of the
# each_engine suites)
ENGINES_UNDER_TEST = tuple(os.environ.get("HMP_TEST_ENGINES", "python,autocast").split(","))


@pytest.fixture(params=ENGINES_UNDER_TEST)
def each_engine(request, monkeypatch):
    """The test once per engine: convert()'s default (HMP_ENGINE) set to each (docs/engines.md). A test
    marked ``compiled`` skips the engine where torch's dynamo cannot trace its switch (docs/torch-releases.md)."""
    switch = torch_releases.BOUNDARIES["traced_autocast_switch"]
    if request.param == "autocast" and request.node.get_closest_marker("compiled") and not switch.present:
        pytest.skip(f"torch {torch_releases.VERSION} predates {switch.first} ({switch.what}): {switch.without}")
    monkeypatch.setenv("HMP_ENGINE", request.param)
    return request.param


@pytest.fixture
def pristine():
    hmp.revert()
    before = snapshot()
    yield before
    hmp.revert()
    assert_same(before, snapshot())


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)
