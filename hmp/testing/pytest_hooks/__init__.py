"""hmp's pytest plugin: the ``hmp_converted`` fixture and the ``hmp`` marker.

pytest loads it through the ``pytest11`` entry point named ``hmp`` (disable
it with ``-p no:hmp``). The wheel installs this package twice: here, and as
the top-level module ``_hmp_pytest`` the entry point names, so that pytest's
start imports neither hmp nor torch. A test that uses neither the fixture
nor the marker meets nothing of it; the first one that does imports
hmp.testing.plugin, which converts and checks.

    @pytest.mark.hmp(opt_level="O1", bf16_file_path="my_bf16.txt")
    def test_lists(): ...           # runs converted; the next test does not

    def test_default(hmp_converted): ...   # hmp.convert() with its defaults

Any other test that leaves hmp converted (a ``converted()`` block never
exited, ``convert()`` without ``revert()``), casts off or a wrapper in torch
errors at its teardown (hmp.testing.plugin.LeakCheck), once hmp is imported: this
module looks for it in sys.modules and imports nothing before.
"""

import importlib
import sys

import pytest

MARKER = "hmp"
FIXTURE = "hmp_converted"
_BLOCK = pytest.StashKey()
_LEAK_CHECK = pytest.StashKey()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"{MARKER}(opt_level='O1', bf16_file_path='', fp32_file_path='', ..., strict=None): run the test under "
        f"hmp.convert() with these arguments (the {FIXTURE} fixture); the conversion in force before is back "
        "when the test returns. A relative list file path is read from the test file's folder.",
    )


def pytest_collection_modifyitems(items):
    """A test with the marker gets the fixture without naming it."""
    for item in items:
        names = getattr(item, "fixturenames", None)
        if names is not None and FIXTURE not in names and item.get_closest_marker(MARKER) is not None:
            item.fixturenames = [*names, FIXTURE]  # its own list: parametrized items share the closure's


@pytest.fixture
def hmp_converted(request):
    """hmp converted for this test, with the ``hmp`` marker's arguments
    (``hmp.convert()``'s defaults without one); yields
    ``hmp.effective_lists(detail=True)``. When the test returns, the
    conversion in force before it is back, and a test that left hmp
    converted, casts off or a wrapper in torch fails (and is cleaned up)."""
    block = importlib.import_module("hmp.testing.plugin").ConversionUnderTest(request.node)
    request.node.stash[_BLOCK] = block
    try:
        yield block.lists
    finally:
        block.close()  # when the test did not run to its end (setup of a later fixture failed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    outcome = yield
    block = item.stash.get(_BLOCK, None)
    if block is None:
        return
    problems = block.close()
    if problems and outcome.excinfo is None:
        _fail(outcome, problems)


def _plugin():
    """hmp.testing.plugin once the program has imported hmp, else None (nothing imported)."""
    return importlib.import_module("hmp.testing.plugin") if "hmp.driver.conversion" in sys.modules else None


def _fail(outcome, problems):
    failure = pytest.fail.Exception("\n".join(problems), pytrace=False)
    force = getattr(outcome, "force_exception", None)  # pluggy 1.1 and newer
    if force is None:
        raise failure
    force(failure)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    plugin = _plugin()
    leak_check = plugin.LeakCheck() if plugin is not None else None
    yield
    if leak_check is None:
        plugin = _plugin()
        leak_check = plugin.LeakCheck(imported=False) if plugin is not None else None
    if leak_check is not None:
        leak_check.set_up()
        item.stash[_LEAK_CHECK] = leak_check


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    outcome = yield
    leak_check = item.stash.get(_LEAK_CHECK, None)
    if leak_check is None:
        plugin = _plugin()
        leak_check = plugin.LeakCheck(imported=False) if plugin is not None else None
    problems = leak_check.close() if leak_check is not None else []
    if problems and outcome.excinfo is None:
        _fail(outcome, problems)
