"""Counting the casts hmp makes, per op, without touching hmp's core.

hmp has no profiling hook, so this watches it from the outside with a
``torch.overrides.TorchFunctionMode``, which sees every torch call made
while it is active, including ``Tensor.to`` calls and the calls hmp's
wrappers make to the original ops.

An hmp wrapper runs in a fixed order: its policy reads the arguments'
dtypes and casts some of them (each cast is ``torch._C.TensorBase.to``
called from hmp's own code), then it calls the op it wraps. So a ``to``
call whose caller is a module of the ``hmp`` package (not this demo) is a
cast hmp made, and the casts waiting when the next real op call arrives
belong to that op. Attribute reads (``tensor.dtype``, which also reach the
mode) and the helpers hmp's policies call (``torch.promote_types``) are not
ops and are skipped. The mode is inactive inside its own handler, so an op's
internal calls are not seen: each user-level op is seen once.

What it counts is what hmp adds to a forward pass (and to anything else run
under the mode): the backward pass turns the gradients of cast tensors back
through autograd on its own, and optimizer steps run under
``hmp.disable_casts()``, so neither issues hmp casts.
"""

import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

UNATTRIBUTED = "(unattributed)"


def op_name(func):
    name = getattr(func, "__name__", None) or repr(func)
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        name = name[2:-2]  # __add__ -> add, __rmul__ -> rmul
    return name


def _is_hmp_core(module_name):
    return module_name.startswith("hmp.") and not module_name.startswith("hmp.demo")


class CastCounter(TorchFunctionMode):
    """``with CastCounter() as c: ...`` then ``c.casts`` maps ``(op, dtype)``
    to the number of arguments hmp cast to ``dtype`` for that op, ``c.calls``
    maps op to how often it ran and ``c.bytes_cast`` totals the casts' outputs."""

    def __init__(self):
        super().__init__()
        self.casts = Counter()
        self.calls = Counter()
        self.bytes_cast = 0
        self._pending = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":  # an attribute read such as tensor.dtype, not an op
            return func(*args, **kwargs)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        out = func(*args, **kwargs)
        if _is_hmp_core(caller):
            if name == "to":
                if isinstance(out, torch.Tensor) and args and out is not args[0]:
                    self._pending.append(out.dtype)
                    self.bytes_cast += out.numel() * out.element_size()
                return out
            if caller != "hmp.wrap":  # a policy's helper (promote_types), not the op
                return out
        # a real op call; the casts made just before it were made for it
        op = op_name(func)
        self.calls[op] += 1
        self._flush(op)
        return out

    def _flush(self, op):
        for dtype in self._pending:
            self.casts[op, dtype] += 1
        self._pending.clear()

    def __exit__(self, *exc):
        self._flush(UNATTRIBUTED)
        return super().__exit__(*exc)

    def per_op(self, scale=1.0):
        """``{op: {dtype name: count * scale}}``, ops with the most casts first."""
        table = {}
        for (op, dtype), n in self.casts.items():
            table.setdefault(op, {})[str(dtype).replace("torch.", "")] = n * scale
        return dict(sorted(table.items(), key=lambda kv: (-sum(kv[1].values()), kv[0])))

    def total(self):
        return sum(self.casts.values())
