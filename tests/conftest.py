import pytest
import torch
import torch.nn.functional as F

import hmp

NAMESPACES = {"torch": torch, "torch.nn.functional": F, "torch.Tensor": torch.Tensor}

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def snapshot():
    """Every entry of the patched namespaces, by identity."""
    return {name: dict(vars(ns)) for name, ns in NAMESPACES.items()}


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
    assert hmp.casts_enabled(), "a test left disable_casts active"


@pytest.fixture
def one_intra_op_thread():
    """Tiny models: intra-op threads only spin against each other (and
    against other processes on a 2-core machine); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
