"""What the docs say a loop casts is what it casts: every line of a docs/*.md Python block whose
comment says "each weight cast to bf16 once|twice ..." is checked by running the block under a
dispatch mode that counts the bf16 casts of weight-shaped tensors made by that line."""

import re
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hmp

DOCS = Path(__file__).resolve().parents[2] / "docs"
CLAIM = re.compile(r"#.*each weight cast to bf16 (once|twice|\d+ times)")
TIMES = {"once": 1, "twice": 2}


def _blocks():
    for path in sorted(DOCS.glob("*.md")):
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
            if CLAIM.search(block):
                yield pytest.param(block, id=f"{path.name}:{block.splitlines()[0][:30]}")


class _WeightCasts(TorchDispatchMode):
    """bf16 conversions of tensors shaped as the model's weights, by the source line that made them."""

    def __init__(self, filename):
        super().__init__()
        self.filename, self.shapes, self.by_line = filename, set(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        bf16 = getattr(out, "dtype", None) is torch.bfloat16
        if bf16 and args and getattr(args[0], "dtype", None) is torch.float32 and tuple(args[0].shape) in self.shapes:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename != self.filename:
                frame = frame.f_back
            if frame is not None:
                self.by_line[frame.f_lineno] = self.by_line.get(frame.f_lineno, 0) + 1
        return out


@pytest.mark.parametrize("block", list(_blocks()))
def test_the_cast_counts_the_docs_state_are_true(block):
    filename = "<docs block>"
    counter = _WeightCasts(filename)
    scope = {}
    original = torch.nn.Sequential.__init__

    def noting(module, *a, **k):  # the block's model: its weights' shapes are what is counted
        original(module, *a, **k)
        counter.shapes |= {tuple(p.shape) for p in module.parameters()}

    torch.nn.Sequential.__init__ = noting
    try:
        with counter:
            exec(compile(block, filename, "exec"), scope)
    finally:
        torch.nn.Sequential.__init__ = original
        hmp.revert()
    weights = len(counter.shapes)
    claims = [(n, CLAIM.search(line).group(1)) for n, line in enumerate(block.splitlines(), 1) if CLAIM.search(line)]
    assert claims and weights
    for line, said in claims:
        times = TIMES.get(said) or int(said.split()[0])
        assert counter.by_line.get(line, 0) == times * weights, (line, said, counter.by_line)
