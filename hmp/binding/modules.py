"""Precision by module: every call of a listed module class (or instance) runs its whole
``forward`` under one list's rule.

- **FP32 list**: lower-precision inputs and outputs go to float32; nothing inside is cast.
- **BF16 list**: float32 inputs go to the lower dtype and every op inside computes in
  it, as if the module were ``.to(bfloat16)`` for the call: listed ops through their
  wrappers, others through a TorchFunctionMode pushed only while such a module runs.
  FP32-list ops stay float32; stored parameters and their gradients stay float32.

The innermost module policy wins; ``disable_casts()``, torch.autocast regions,
backward and an enclosing listed op win over all of them. A class entry patches
``__call__`` on the class and its subclasses that define their own, so ``forward``
stays the class's; an instance entry sets ``forward`` on the instance. Both go
through the patch log, so revert() restores them exactly. What runs in the module's
calls (the forwards, the BF16 module's mode) is hmp/core/module_rules.py's; this
module builds it and decides each op's rule inside a BF16 module."""

import inspect
import types

import torch

from hmp.binding import refusals
from hmp.binding.aten import returns_view
from hmp.binding.module_entries import Pattern, resolved
from hmp.binding.pays import NORMALIZATIONS
from hmp.binding.resolve import writes
from hmp.core import dtypes, module_rules, policy
from hmp.core.identity import mark, unwrap
from hmp.core.module_rules import OWN, getstate, is_entry

# calls the lower-precision mode leaves alone: dtype and device conversions
# (they say what dtype they want), and questions about a tensor
_UNCAST = frozenset(
    (
        "__get__",
        "__set__",
        "__delete__",
        "to",
        *refusals.DTYPE_CONVERSIONS,
        "cpu",
        "cuda",
        "numpy",
        "tolist",
        "item",
        "size",
        "dim",
        "numel",
        "stride",
        "storage_offset",
        "data_ptr",
        "element_size",
        "is_floating_point",
        "is_complex",
        "is_contiguous",
        "__len__",
        "__repr__",
        "__format__",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__reduce_ex__",
        "__deepcopy__",
        "__hash__",
        "__array__",
    )
)


def _writes_first(name):
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i") or name == "__setitem__"


def op_rules(low, casters, fp32_names):
    """``decide(func)``: the prepare an op not in a listed wrapper gets inside a BF16 module
    (core/module_rules.py's LowerMode asks once per op): its float32 arguments to the lower
    dtype (the FP32 list's ops to float32, an in-place op's arguments to the dtype of the tensor
    it writes, a normalisation with running statistics its input only: the statistics it writes
    stay the module's own tensors, in their dtype)."""
    out = policy.inplace_out(casters)
    lower, lower_input = policy.lower(low, casters, out), policy.lower_input_only(low, casters, out)
    fp32, into = policy.fp32(low, casters, out), policy.inplace_self(casters)

    def decide(func):
        name = getattr(func, "__name__", "")
        op = name[2:-2] if name.startswith("__") and name.endswith("__") else name
        if name in _UNCAST or returns_view(op) or name == "__getitem__":  # a view must stay a view
            return policy.cast_nothing
        if _writes_first(name):
            return into
        written = writes(func, op)  # batch_norm's running statistics: never a cast copy
        if op in fp32_names:
            prepare = fp32
        else:
            prepare = lower_input if written and op in NORMALIZATIONS else lower
        return policy.written_into(written, prepare, casters) if written else prepare

    return decide


class Forwards:
    """The forward replacements of one conversion; ``in_force`` until its revert()."""

    def __init__(self, low, casters, fp32_names):
        self.in_force = True
        self._fp32_in = policy.fp32(low, casters)
        self._fp32_out = module_rules.to_float32(casters[torch.float32].any, dtypes.LOW)
        self._lower_in = policy.lower_tensors(low, casters)
        self._mode = module_rules.LowerMode(op_rules(low, casters, fp32_names))

    def replacing(self, kind, original, name="forward"):
        """``name(self, ...)`` (a module's ``forward``, or a class's
        ``__call__``) running ``original`` under ``kind``'s module rule (its
        record's ``module_rule``); a ValueError for a kind that has none."""
        rule = kind.module_rule
        if rule is None:
            raise ValueError(f"hmp: the {kind.name} list takes no module entries")
        fn = getattr(self, rule)(original)
        fn.__name__ = name  # a bound copy pickles as getattr(module, "forward")
        fn.__qualname__ = getattr(original, "__qualname__", name)
        fn.__doc__ = getattr(original, "__doc__", None)
        mark(fn, original)
        return fn

    def in_float32(self, original):
        """The FP32 module rule: ``original`` computes in float32, its outputs float32 too."""
        return module_rules.fp32_forward(original, self._fp32_in, self._fp32_out, self)

    def in_lower(self, original):
        """The lower list's module rule: every op of ``original`` in the lower dtype."""
        return module_rules.lower_forward(original, self._lower_in, self._mode, self)


def on_import(modules, watch, forwards, later):
    """Have ``watch`` (imports.Watch) give the classes of a Pattern in a
    module imported later their entry (a class that already has one keeps it)."""
    taken = {c for entries in resolved(modules).values() for c in entries if isinstance(c, type)}
    for kind, entries in modules.items():
        for entry in entries:
            if isinstance(entry, Pattern):
                watch.add(entry.module, _late(entry, kind, forwards, taken, later))


def _late(pattern, kind, forwards, taken, later):
    def resolve(module):
        found = [c for c in pattern.classes(module) if c not in taken]
        taken.update(found)
        for namespace, attr, value in patches({kind: found}, forwards):
            later(namespace, attr, value)

    return resolve


def patches(modules, forwards):
    """``[(namespace, "forward", replacement)]`` for ``modules`` (kind ->
    classes, instances and Patterns); builds everything, changes nothing."""
    modules = resolved(modules)
    listed = {t for entries in modules.values() for t in entries if isinstance(t, type)}
    out, seen = [], set()
    for kind, entries in modules.items():
        for entry in entries:
            if isinstance(entry, type):
                # a class's rule wraps its __call__: forward stays the class's own, so what the class's
                # machinery checks of it holds (transformers' GradientCheckpointingLayer checkpoints only
                # while type(self).forward is its own wrapper)
                for cls in _classes_under(entry, listed, CALL):
                    if cls not in seen:
                        seen.add(cls)
                        original = unwrap(inspect.getattr_static(cls, CALL))
                        out.append((cls, CALL, forwards.replacing(kind, original, CALL)))
            else:
                fn = forwards.replacing(kind, _instance_forward(entry))
                setattr(fn, OWN, _instance_own(entry, "forward"))
                out.append((entry, "forward", types.MethodType(fn, entry)))
                out.append(
                    (entry, "__getstate__", types.MethodType(getstate(_instance_own(entry, "__getstate__")), entry))
                )
    return out


def _instance_own(module, name):
    """What ``module`` holds in its own __dict__ under ``name`` without hmp
    (an entry of a conversion still in place is looked through)."""
    own = module.__dict__.get(name)
    return getattr(own.__func__, OWN) if is_entry(own, module) else own


CALL = "__call__"


def _classes_under(cls, listed, attr):
    """``cls`` and its subclasses that define their own ``attr``, except
    those under another listed class (that one's rule is closer)."""
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        if c is not cls and c in listed:
            continue
        if c is cls or attr in c.__dict__:
            out.append(c)
        todo.extend(c.__subclasses__())
    return out


def _instance_forward(module):
    """What ``module.forward`` runs without hmp, as ``f(self, ...)``."""
    own = _instance_own(module, "forward")
    if own is None:
        return unwrap(inspect.getattr_static(type(module), "forward"))
    if isinstance(own, types.MethodType) and own.__self__ is module:
        return unwrap(own.__func__)
    return lambda self, *args, **kwargs: own(*args, **kwargs)  # someone's own per-instance forward
