"""Which list names are pointwise ops, read from torch's op tags.

A pointwise op costs one pass over memory in either dtype: casting its
float32 inputs down first costs passes, not fewer, and what it would round
may be the program's state (an EMA, a metric's sums). So an op in the BF16
list that is pointwise is left as torch's own object (docs/never-changes.md):
torch's type promotion runs it in bfloat16 when its floating inputs are,
in float32 when one is float32.
"""

import functools
import operator

import torch

from hmp.core import torch_private
from hmp.core.aten import aten_op

_POINTWISE, _SEEDED = torch.Tag.pointwise, torch.Tag.nondeterministic_seeded


@functools.lru_cache(maxsize=None)
def is_pointwise(name):
    """True when list name ``name`` binds a pointwise op: an overload of
    ``aten::name`` carries torch's ``pointwise`` tag, or (an alias such as
    ``multiply``, a Python operator name such as ``truediv`` or Habana's
    ``iadd``) a call of it on float tensors reaches only tagged overloads."""
    packet = aten_op(name)
    if packet is not None and any(_POINTWISE in getattr(packet, o).tags for o in packet.overloads()):
        return True
    fn = packet if packet is not None else getattr(operator, name, None)
    if fn is None or name.startswith("_"):
        return False
    if packet is not None and any(_SEEDED in getattr(packet, o).tags for o in packet.overloads()):
        return False  # a random op: calling it would move the program's random stream
    for arity in (2, 1):
        args = [torch.ones(2) for _ in range(arity)]
        try:
            reached = torch_private.reached_ops(fn, *args)
        except Exception:  # not callable with float tensors alone: not a pointwise op for this rule
            continue
        return bool(reached) and all(_POINTWISE in op.tags for op in reached)
    return False
