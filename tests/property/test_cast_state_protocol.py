"""The thread's cast state under blocks entered and left in any order.

Oracle, written from the documented rule and not from hmp/core/state.py: hmp
casts exactly when the most recently entered block that is still open turns
casts on (``enable_casts()``), or, with no block open, when casting was on
before the first one. Leaving blocks out of order (generators closed inside
blocks they did not open, a Lightning run's block left at teardown) never
leaves casts off or on where that rule says otherwise, and leaving every
block restores the state found before the first.
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hmp

KINDS = {
    "disable": (hmp.disable_casts, False),
    "enable": (hmp.enable_casts, True),
    "autocast off": (lambda: torch.autocast("cpu", enabled=False), False),
}


def _expected(open_blocks, base):
    return KINDS[open_blocks[-1][0]][1] if open_blocks else base


@st.composite
def programs(draw):
    """(kinds entered in order, order in which they are left: indexes into the entered ones)."""
    kinds = draw(st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=6))
    exits = draw(st.permutations(range(len(kinds))))
    # interleave: each exit may only come after its block's entry
    steps, entered, pending = [], 0, list(exits)
    while pending:
        ready = [i for i in pending if i < entered]
        if entered < len(kinds) and (not ready or draw(st.booleans())):
            steps.append(("enter", entered))
            entered += 1
        else:
            i = ready[0]
            pending.remove(i)
            steps.append(("leave", i))
    return kinds, steps


@settings(deadline=None)
@given(programs(), st.booleans())
def test_blocks_left_in_any_order_follow_the_newest_open_block(program, start_disabled):
    kinds, steps = program
    hmp.convert()
    outer = hmp.disable_casts() if start_disabled else None
    if outer is not None:
        outer.__enter__()
    base = hmp.casts_enabled()
    assert base is not start_disabled
    blocks, open_blocks = {}, []
    try:
        for action, i in steps:
            if action == "enter":
                blocks[i] = KINDS[kinds[i]][0]()
                blocks[i].__enter__()
                open_blocks.append((kinds[i], i))
            else:
                blocks[i].__exit__(None, None, None)
                open_blocks.remove((kinds[i], i))
            assert hmp.casts_enabled() is _expected(open_blocks, base), (steps, action, i)
            x = torch.ones(2)
            assert torch.dot(x, x).dtype == (torch.bfloat16 if _expected(open_blocks, base) else torch.float32)
        assert hmp.casts_enabled() is base
    finally:
        if outer is not None:
            outer.__exit__(None, None, None)
    assert hmp.casts_enabled()
