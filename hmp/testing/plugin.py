"""What hmp's pytest plugin does for a test that asks for it (the
``hmp_converted`` fixture, or the ``hmp`` marker): convert with the
marker's arguments for the test, and when the test returns, put back the
conversion in force before it and check that nothing of hmp stayed: no
conversion the test left in force, no ``disable_casts()`` block left open,
no hmp wrapper left in torch's namespaces. What stayed fails that test, and
is undone so the next test starts as this one did.

Every other test is watched too, once it or its fixtures have imported hmp
(``LeakCheck``): after its fixtures' teardown, a conversion in force that was not
before the test (nor after its setup), a ``disable_casts()`` block left open
or a wrapper left in torch is that test's error, and is undone.

pytest loads the hooks from hmp/testing/pytest_hooks (the entry point),
which imports this module only when a test asks for hmp."""

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from hmp.core import state
from hmp.core.identity import unwrap
from hmp.core.switches import casts_enabled
from hmp.driver.conversion import converted, restore
from hmp.driver.queries import effective_lists, in_force

MARKER = "hmp"
# convert()'s parameters in order, for a marker's positional arguments
POSITIONAL = ("opt_level", "bf16_file_path", "fp32_file_path", "isVerbose", "low_precision_type")
PATHS = ("bf16_file_path", "fp32_file_path", "promote_file_path", "fp16_file_path", "uncast_file_path")


def marker_arguments(node):
    """convert()'s arguments from the ``hmp`` markers on ``node`` (a class's,
    then the test's, the closer one winning). A relative list file path is
    read from the test file's folder when the file is there."""
    kwargs = {}
    for mark in reversed(list(node.iter_markers(MARKER))):
        if len(mark.args) > len(POSITIONAL):
            raise TypeError(f"@pytest.mark.{MARKER}: at most {len(POSITIONAL)} positional arguments ({POSITIONAL})")
        kwargs.update(zip(POSITIONAL, mark.args))
        kwargs.update(mark.kwargs)
    folder = Path(str(node.fspath)).parent
    for key in PATHS:
        value = kwargs.get(key)
        if isinstance(value, (str, os.PathLike)) and str(value) and not os.path.isabs(value):
            beside = folder / value
            if beside.is_file():
                kwargs[key] = str(beside)
    return kwargs


def _namespaces():
    found = [torch, F, torch.Tensor, torch.linalg, torch.special, torch.fft]
    ops = sys.modules.get("torchvision.ops")
    return found + ([ops] if ops is not None else [])


def wrappers_left():
    """``["torch.mm", ...]``: torch attributes that still hold an hmp wrapper."""
    left = []
    for ns in _namespaces():
        for attr, value in list(vars(ns).items()):
            if callable(value) and unwrap(value) is not value:
                left.append(f"{getattr(ns, '__name__', ns)}.{attr}")
    return left


class ConversionUnderTest:
    """One test's conversion: made at the fixture's setup, closed when the
    test returns (``close()``: the problems it found, once)."""

    def __init__(self, node):
        kwargs = marker_arguments(node)
        self.before = in_force()
        self.frames = len(state.tls.frames)
        self.block = converted(**kwargs)
        self.block.__enter__()
        self.lists = effective_lists(detail=True)
        self.closed = False

    def close(self):
        if self.closed:
            return []
        self.closed = True
        problems = []
        if not casts_enabled() or len(state.tls.frames) > self.frames:
            problems.append("left hmp's casts off in this thread (a disable_casts() block entered, never exited)")
            while len(state.tls.frames) > self.frames:
                state.leave(state.tls.frames[-1])
        self.block.__exit__(None, None, None)
        if in_force() is not self.before:
            problems.append("left hmp converted (a convert() or converted() block the test did not undo)")
            restore(self.before)
        if self.before is None:
            left = wrappers_left()
            if left:
                problems.append(f"left hmp wrappers in torch after revert(): {', '.join(left[:10])}")
        return [f"hmp: the test {p}" for p in problems]


class LeakCheck:
    """What a test without the marker or the fixture left of hmp: the state
    before its setup (``imported=False``: hmp was not imported yet, so not
    converted), after its setup (``set_up()``), and after its fixtures'
    teardown (``close()``: the problems, each undone)."""

    def __init__(self, imported=True):
        self.before = [in_force()] if imported else [None]
        self.frames = len(state.tls.frames) if imported else 0

    def set_up(self):
        self.before.append(in_force())

    def close(self):
        problems = []
        if len(state.tls.frames) > self.frames:
            problems.append("left hmp's casts off in this thread (a disable_casts() block entered, never exited)")
            while len(state.tls.frames) > self.frames:
                state.leave(state.tls.frames[-1])
        now = in_force()
        if now is not None and all(now is not b for b in self.before):
            problems.append(
                "left hmp converted (a converted() block entered and never exited, or convert() without revert()); "
                "use `with hmp.converted(...):` or @pytest.mark.hmp(...)"
            )
            restore(self.before[0])
        elif now is None and self.before[0] is None:
            left = wrappers_left()
            if left:
                problems.append(f"left hmp wrappers in torch after revert(): {', '.join(left[:10])}")
        return [f"hmp: the test {p}" for p in problems]
