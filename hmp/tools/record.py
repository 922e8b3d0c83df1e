"""Recording what hmp's wrappers do, for hmp.profile / hmp.audit / hmp.tune.

A conversion built with a Recorder gets instrumented prepare functions and
op adapters; an ordinary conversion has none of this (nothing is left
behind once the recording conversion is replaced). Only the outermost
listed op of a call is recorded, as only it casts.

For audit and tune, ``ModuleHooks`` also puts forward hooks on a model's
modules for one recorded run: they keep the stack of modules running, so
each op output is recorded with the innermost module it ran in, and they
record each module call's output. They are removed when the run ends.
"""

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from hmp.core import dtypes
from hmp.core.torch_private import tree_flatten, tree_leaves, tree_map_only, tree_unflatten

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
    return tuple(dtypes.name(t.dtype) for t in tensors)


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


def ran_in(stats):
    """The floating dtypes an op's most common call ran with (``bfloat16``, ``float32,bfloat16``)."""
    if not stats.chosen_dtypes:
        return ""
    names = stats.chosen_dtypes.most_common(1)[0][0]
    return ",".join(dict.fromkeys(n for n in names if n in ("float32", "bfloat16", "float16", "float64")))


class Output(NamedTuple):
    name: str  # the op's name, or a module's path for a module call
    value: tuple  # snapshot() of what it returned
    module: Optional[str] = None  # path of the innermost hooked module the op ran in, if any


class Recorder:
    """Collects per-op statistics and, when asked, each call's output (and
    each hooked module call's output, see ModuleHooks)."""

    def __init__(self, keep_outputs=False, restore_dtype=False, forced=None, module_outputs=False, cast_only_in=None):
        # restore_dtype: cast an op's floating outputs back to the dtype of its
        # first floating input, so only this op's rounding reaches the rest
        # of the model (used to measure one op at a time).
        # forced: a reference run's outputs, {op: {module path: [outputs]}};
        # each recorded call passes on the reference's output of the same
        # call instead of its own (gradients flow through its own), so no
        # call's error reaches the next: each call's error is its own.
        # module_outputs: keep each hooked module call's output too
        # cast_only_in: module paths; an op called directly in another (or in
        # none) casts nothing, as in the fp32 run (see Confinement)
        self.cast_only_in = cast_only_in
        self.keep_outputs, self.restore_dtype, self.forced = keep_outputs, restore_dtype, forced
        self.keep_module_outputs = module_outputs
        self._forced_calls = Counter()  # (op, module path) -> calls forced so far
        self.stats = {}
        self.outputs = []  # Output per op call, in call order
        self.module_outputs = []  # Output per hooked module call, named by the module's path
        self.seen = {}  # module path -> the largest position/timestep (an integer tensor's value) it was given
        self._tls = ThreadModules()

    def _stack(self):
        return self._tls.modules

    def _inside(self):
        stack = self._stack()
        return bool(stack) and stack[-1] in self.cast_only_in

    def entering(self, path):
        """A forward pre-hook (with kwargs): ``path``'s module starts running;
        the largest position or timestep it is given is kept (``seen``)."""

        def hook(module, args, kwargs):
            self._stack().append(path)
            largest = _largest_index((args, kwargs))
            if largest is not None:
                self.seen[path] = max(self.seen.get(path, largest), largest)

        return hook

    def leaving(self, path):
        """A forward hook: ``path``'s module returned ``output``."""

        def hook(module, args, output):
            stack = self._stack()
            if path in stack:  # also drops what a child that raised left behind
                del stack[len(stack) - 1 - stack[::-1].index(path) :]
            if self.keep_module_outputs:
                self.module_outputs.append(Output(path, snapshot(output)))

        return hook

    def prepare(self, prepare, name):
        def recorded_prepare(args, kwargs):
            before = _tensors(args, kwargs)
            _synchronize(before)
            start = time.perf_counter()
            if self.cast_only_in is None or self._inside():
                new_args, new_kwargs = prepare(args, kwargs)
            else:
                new_args, new_kwargs = args, kwargs
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
                    stats.cast_to[dtypes.name(new.dtype)] += 1
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
                stack = self._stack()
                module = stack[-1] if stack else None
                self.outputs.append(Output(name, snapshot(out), module))
                if self.forced is not None:
                    out = self._force(name, module, out)
            return out

        return recorded_op

    def _force(self, name, module, out):
        key = (name, module)
        i = self._forced_calls[key]
        self._forced_calls[key] += 1
        refs = self.forced.get(name, {}).get(module, [])
        if i >= len(refs):
            return out
        ref = iter(refs[i])
        leaves, spec = tree_flatten(out)
        for j, leaf in enumerate(leaves):
            if isinstance(leaf, _Tensor) and leaf.is_floating_point():
                r = next(ref, None)
                if r is not None and r.shape == leaf.shape and r.dtype == leaf.dtype:
                    leaves[j] = _Forced.apply(leaf, r)
        return tree_unflatten(leaves, spec)


class _Forced(torch.autograd.Function):
    """``ref``'s values, with ``got``'s place in the graph."""

    @staticmethod
    def forward(ctx, got, ref):
        return ref.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _restore(value, dtype):
    if isinstance(value, _Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if type(value) is tuple or type(value) is list:
        return type(value)(_restore(v, dtype) for v in value)
    return value


def snapshot(value):
    """Detached copies of the floating tensors in an op's or a module's
    output (tensors inside tuples, lists, dicts, torch.return_types,
    transformers' ModelOutput)."""
    return tuple(t.detach().clone() for t in tree_leaves(value) if isinstance(t, _Tensor) and t.is_floating_point())


def module_paths(objects):
    """``{path: module}`` for every submodule of the modules among
    ``objects``, each module once. One root: paths as ``named_modules()``
    gives them (the root is ``""``); several: as if the roots were items of
    one ``ModuleList`` (``"0"``, ``"0.fc"``, ``"1"``). ScriptModules are
    left out: they take no hooks, and hmp casts nothing inside them."""
    roots = [o for o in objects if isinstance(o, torch.nn.Module)]
    out, seen = {}, set()
    for i, root in enumerate(roots):
        for name, module in root.named_modules():
            if id(module) in seen or isinstance(module, torch.jit.ScriptModule):
                continue
            seen.add(id(module))
            prefix = str(i) if len(roots) > 1 else ""
            out[".".join(p for p in (prefix, name) if p)] = module
    return out


class ModuleHooks:
    """Forward hooks on ``paths``' modules (module_paths()) reporting to
    ``recorder``, for the duration of a ``with`` block; removed on exit,
    also when the block raises."""

    def __init__(self, recorder, paths):
        self.recorder, self.paths, self.handles = recorder, paths, []

    def __enter__(self):
        try:
            for path, module in self.paths.items():
                self.handles.append(module.register_forward_pre_hook(self.recorder.entering(path), with_kwargs=True))
                self.handles.append(module.register_forward_hook(self.recorder.leaving(path)))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc):
        self._remove()

    def _remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _largest_index(value):
    """The largest value of the integer tensors in ``value`` (positions,
    timesteps, token ids), or None when it holds none."""
    found = [
        t
        for t in tree_leaves(value)
        if isinstance(t, _Tensor)
        and t.numel()
        and not t.is_floating_point()
        and not t.is_complex()
        and t.dtype is not torch.bool
    ]
    return max(int(t.max()) for t in found) if found else None


def _float32(value):
    return tree_map_only(_Tensor, lambda t: t.float() if t.dtype in dtypes.LOW else t, value)


class ThreadModules(threading.local):
    """Per thread, the paths of the hooked modules whose forward is running, innermost last."""

    def __init__(self):
        self.modules = []


def within(path, outer):
    """True when module path ``path`` is ``outer`` or inside it (``""``: the root, holding every path)."""
    return outer == "" or path == outer or path.startswith(outer + ".")


class Confinement:
    """For one run with ``Recorder(cast_only_in=inside)``: the modules at
    ``inside`` pass their outputs on in float32, and the hooked modules
    within them that are not themselves inside take their inputs in
    float32, so only the code of the modules at ``inside`` computes in the
    lower dtype and what it rounds is all that reaches the rest."""

    def __init__(self, paths, inside):
        self.paths, self.inside, self.handles = paths, set(inside), []

    def __enter__(self):
        try:
            for path, module in self.paths.items():
                if path in self.inside:
                    self.handles.append(module.register_forward_hook(lambda m, args, out: _float32(out)))
                elif any(within(path, outer) for outer in self.inside):
                    self.handles.append(
                        module.register_forward_pre_hook(
                            lambda m, args, kwargs: _float32((args, kwargs)), with_kwargs=True
                        )
                    )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []
