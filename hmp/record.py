"""Recording what hmp's wrappers do, for hmp.profile / hmp.audit / hmp.tune.

A conversion built with a Recorder gets instrumented prepare functions and
op adapters; an ordinary conversion has none of this (nothing is left
behind once the recording conversion is replaced). Only the outermost
listed op of a call is recorded, as only it casts.
"""

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

_Tensor = torch.Tensor


def _tensors(args, kwargs):
    out = []

    def visit(v):
        if isinstance(v, _Tensor):
            out.append(v)
        elif type(v) is list or type(v) is tuple:
            for x in v:
                visit(x)

    for a in args:
        visit(a)
    if kwargs:
        for v in kwargs.values():
            visit(v)
    return out


def _dtype_names(tensors):
    return tuple(str(t.dtype).replace("torch.", "") for t in tensors)


def _synchronize(tensors):
    for t in tensors:
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)
            return


@dataclass
class OpStats:
    calls: int = 0
    input_dtypes: Counter = field(default_factory=Counter)  # tuple of dtype names -> calls
    chosen_dtypes: Counter = field(default_factory=Counter)
    op_seconds: float = 0.0
    cast_seconds: float = 0.0
    casts: int = 0
    cast_to: Counter = field(default_factory=Counter)  # dtype name -> tensors cast to it
    bytes_cast: int = 0


class Recorder:
    """Collects per-op statistics and, when asked, each call's output."""

    def __init__(self, keep_outputs=False, restore_dtype=False):
        # restore_dtype: cast an op's floating outputs back to the dtype of its
        # first floating input, so only this op's rounding reaches the rest
        # of the model (used to measure one op at a time)
        self.keep_outputs, self.restore_dtype = keep_outputs, restore_dtype
        self.stats = {}
        self.outputs = []  # (op name, output) in call order
        self._tls = threading.local()

    def prepare(self, prepare, name):
        def recorded_prepare(args, kwargs):
            before = _tensors(args, kwargs)
            _synchronize(before)
            start = time.perf_counter()
            new_args, new_kwargs = prepare(args, kwargs)
            after = _tensors(new_args, new_kwargs)
            _synchronize(after)
            seconds = time.perf_counter() - start
            stats = self.stats.get(name)
            if stats is None:
                stats = self.stats[name] = OpStats()
            stats.calls += 1
            stats.cast_seconds += seconds
            stats.input_dtypes[_dtype_names(before)] += 1
            stats.chosen_dtypes[_dtype_names(after)] += 1
            for old, new in zip(before, after):
                if new is not old:
                    stats.casts += 1
                    stats.cast_to[str(new.dtype).replace("torch.", "")] += 1
                    stats.bytes_cast += new.numel() * new.element_size()
            first = next((t.dtype for t in before if t.is_floating_point()), None)
            self._tls.pending = (name, stats, after, first)
            return new_args, new_kwargs

        return recorded_prepare

    def op(self, op):
        """``op`` timed when called by the outermost wrapper's guarded path."""

        def recorded_op(*args, **kwargs):
            pending = getattr(self._tls, "pending", None)
            if pending is None:
                return op(*args, **kwargs)
            self._tls.pending = None
            name, stats, inputs, first = pending
            start = time.perf_counter()
            out = op(*args, **kwargs)
            _synchronize(inputs)
            stats.op_seconds += time.perf_counter() - start
            if self.restore_dtype and first is not None:
                out = _restore(out, first)
            if self.keep_outputs:
                self.outputs.append((name, snapshot(out)))
            return out

        return recorded_op


def _restore(value, dtype):
    if isinstance(value, _Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if type(value) is tuple or type(value) is list:
        return type(value)(_restore(v, dtype) for v in value)
    return value


def snapshot(value):
    """Detached copies of the floating tensors in an op's output."""
    return tuple(t.detach().clone() for t in _tensors((value,), None) if t.is_floating_point())

