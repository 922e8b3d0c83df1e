import pytest
import torch
import torch.nn.functional as F

import hmp
from hmp import state

NAMESPACES = {"torch": torch, "torch.nn.functional": F, "torch.Tensor": torch.Tensor}

# the running torch's release, (major, minor, patch), for version-gated skips
# (docs/reliability.md, "torch releases": each says which feature needs which torch)
TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:3])


def needs_torch(version, why):
    """Skip below ``version`` (a tuple), saying why; never on a torch that has the feature."""
    return pytest.mark.skipif(TORCH < version, reason=f"needs torch >= {'.'.join(map(str, version))}: {why}")


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

RUN_SLOW = "--run-slow"


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
        state.tls.off = 0
        pytest.fail("the test left hmp.disable_casts() active (casts are still off when it returned)",
                    pytrace=False)
    return result


def snapshot(namespaces=NAMESPACES):
    """Every entry of the given namespaces ({name: module or class}), by identity."""
    return {name: dict(vars(ns)) for name, ns in namespaces.items()}


def assert_same(before, after):
    for name in before:
        b, a = before[name], after[name]
        assert b.keys() == a.keys(), f"{name}: added {set(a) - set(b)}, removed {set(b) - set(a)}"
        changed = [k for k in b if b[k] is not a[k]]
        assert not changed, f"{name}: entries not identical: {changed[:10]}"


ENV_LIST_VARS = ("LOWER_LIST", "FP32_LIST", "PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST", "PT_HPU_AUTOCAST_FP32_OPS_LIST")


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


def write(tmp_path, name, text, mode="w"):
    path = tmp_path / name
    if mode == "wb":
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path
