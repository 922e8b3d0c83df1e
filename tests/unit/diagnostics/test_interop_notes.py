"""hmp's note on a dtype error that is not about a missing list entry."""

import sys

import pytest
import torch

import hmp

needs_notes = pytest.mark.skipif(sys.version_info < (3, 11), reason="add_note is Python 3.11+")


@needs_notes
def test_hook_that_changes_the_dtype_is_not_blamed_on_the_lists():
    w = torch.randn(4, requires_grad=True)
    hmp.convert()
    w.register_hook(lambda g: (g * 2).bfloat16())  # a hook that returns another dtype
    with pytest.raises(RuntimeError, match="has changed the type of value") as info:
        (w * w).sum().backward()
    # noted where it passed through hmp: the backward wrapper (hmp/rules/regions.py)
    (note,) = [n for n in getattr(info.value, "__notes__", ()) if n.startswith("hmp: ")]
    assert "hook '<lambda>'" in note and "not a missing list entry" in note
    assert "result.to(grad.dtype)" in note
    assert "belongs in" not in note and "missing from hmp's lists" not in note
