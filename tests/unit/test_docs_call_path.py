"""docs/call-path.md is a trace, not a description (issue 80): each engine's block lists the
functions of hmp a call of ``F.linear(x, w, b)`` runs, ``file:function`` in call order, indented
by depth, and this test traces the call afresh and compares. A change to the call path that
the page does not show fails here, with the trace to paste."""

import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import profiled

import hmp

HMP = os.path.dirname(hmp.__file__) + os.sep
PAGE = Path(__file__).resolve().parents[2] / "docs" / "call-path.md"


def _traced(engine):
    """``[(depth, "file:function")]`` of hmp for one eager ``F.linear(x, w, b)`` in a training step:
    ``x`` an activation (it requires grad through its graph), ``w`` and ``b`` parameters used for the
    first time in this forward (the last forward's graph, and the copies it held, are gone)."""
    w, b = torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(16))
    x = torch.randn(4, 8, requires_grad=True) * 2
    hmp.convert(engine=engine)
    try:
        F.linear(x, w, b)  # what a process does once (first_time's notes) is not a call's path
        found, depth = [], [0]

        def profile(frame, event, arg):
            name = frame.f_code.co_filename
            if name.startswith(HMP):
                if event == "call":
                    found.append((depth[0], f"{name[len(HMP) :]}:{frame.f_code.co_qualname}"))
                    depth[0] += 1
                elif event == "return":
                    depth[0] -= 1

        with profiled(profile):
            y = F.linear(x, w, b)
        del y
    finally:
        hmp.revert()
    return found


def _documented(engine):
    """The page's block under the heading naming ``engine``: ``[(depth, "file:function")]``."""
    text = PAGE.read_text()
    section = re.search(rf'^## engine="{engine}".*?^```text\n(.*?)^```', text, re.S | re.M)
    assert section, f"{PAGE} has no traced block under '## engine=\"{engine}\"'"
    lines = [line for line in section.group(1).splitlines() if line.strip()]
    return [((len(line) - len(line.lstrip(" "))) // 2, line.split()[0]) for line in lines]


@pytest.mark.parametrize("engine", ["python", "autocast"])
def test_the_call_path_page_is_what_a_call_runs(pristine, engine):
    traced = _traced(engine)
    assert traced, "no frame of hmp ran: F.linear is not wrapped"
    pasted = "\n".join("  " * d + name for d, name in traced)
    assert _documented(engine) == traced, f'docs/call-path.md\'s engine="{engine}" block is now:\n{pasted}'
