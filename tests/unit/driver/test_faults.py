"""Faults injected while convert() patches and while revert() undoes:
torch is never left half-patched with no way back, and the runtime's state
always says what is true."""

import sys
import threading

import pytest
import torch
from helpers import assert_same, snapshot

import hmp
from hmp.driver import patch

BF16 = torch.bfloat16


def entries_patched_by_convert():
    hmp.convert()
    from hmp.core.state import runtime

    n = len(runtime.undo_log)
    hmp.revert()
    return n


class Injected(Exception):
    pass


def fail_on_patch(k, exc):
    """PatchLog.setattr (what convert() patches with) raising on its k-th call."""
    original = patch.PatchLog.setattr
    calls = {"n": 0}

    def flaky(self, namespace, attr, value, **kwargs):
        calls["n"] += 1
        if calls["n"] == k:
            raise exc
        return original(self, namespace, attr, value, **kwargs)

    return flaky


@pytest.mark.parametrize("exc", [Injected("setattr failed"), KeyboardInterrupt()], ids=["error", "interrupt"])
@pytest.mark.parametrize("already_converted", [False, True])
def test_fault_while_convert_patches_leaves_torch_pristine(monkeypatch, pristine, exc, already_converted):
    total = entries_patched_by_convert()
    hooks = (sys.excepthook, threading.excepthook)
    for k in sorted({1, 2, total // 2, total}):
        if already_converted:
            hmp.convert(opt_level="O2")
        monkeypatch.setattr(patch.PatchLog, "setattr", fail_on_patch(k, exc))
        with pytest.raises(type(exc)):
            hmp.convert()
        monkeypatch.undo()
        # the previous conversion was undone before patching began: pristine, and saying so
        assert_same(pristine, snapshot())
        assert not hmp.is_converted() and hmp.effective_lists()["bf16"] == []
        assert (sys.excepthook, threading.excepthook) == hooks and hmp.casts_enabled()
        hmp.convert()  # and it works afterwards
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == BF16
        assert (sys.excepthook, threading.excepthook) == hooks  # convert() never touches them
        hmp.revert()


@pytest.mark.parametrize("exc", [Injected("delattr failed"), KeyboardInterrupt()], ids=["error", "interrupt"])
@pytest.mark.parametrize("via", ["revert", "re-convert"])
def test_fault_while_undoing_is_retried_by_the_next_revert(monkeypatch, pristine, exc, via):
    hmp.convert()
    calls = {"n": 0}

    def flaky(obj, name):
        calls["n"] += obj is torch.Tensor  # an entry snapshot() sees (not a class's __init_subclass__)
        if calls["n"] == 3:
            raise exc
        return delattr(obj, name)

    monkeypatch.setattr(patch, "delattr", flaky, raising=False)
    with pytest.raises(type(exc)):
        hmp.revert() if via == "revert" else hmp.convert(opt_level="O2")
    monkeypatch.undo()
    assert not hmp.is_converted()  # nothing new was patched by the failed convert()
    with pytest.raises(AssertionError):
        assert_same(pristine, snapshot())  # some entries are still patched...
    hmp.revert()  # ...and the next revert() takes them out
    assert_same(pristine, snapshot())
