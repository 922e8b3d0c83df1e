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
through the patch log, so revert() restores them exactly."""

import copy
import dataclasses
import inspect
import types

import torch
from torch.overrides import TorchFunctionMode

from hmp.binding import refusals
from hmp.binding.aten import returns_view
from hmp.binding.module_entries import Pattern, resolved
from hmp.binding.pays import NORMALIZATIONS
from hmp.binding.resolve import writes
from hmp.core import cast_copies, dtypes, policy
from hmp.core.identity import mark, unwrap
from hmp.core.state import MODULE, OFF, enter, leave, tls
from hmp.core.torch_private import tree_map

Module = torch.nn.Module
_is_compiling = torch.compiler.is_compiling

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


class LowerMode(TorchFunctionMode):
    """Inside a BF16 module: each op not in a listed wrapper casts its float32
    arguments to the lower dtype first (the FP32 list's ops to float32, an
    in-place op's arguments to the dtype of the tensor it writes, a
    normalisation with running statistics its input only: the statistics it
    writes stay the module's own tensors, in their dtype)."""

    def __init__(self, low, casters, fp32_names):
        super().__init__()
        out = policy.inplace_out(casters)
        self._lower = policy.lower(low, casters, out)
        self._lower_input = policy.lower_input_only(low, casters, out)
        self._fp32 = policy.fp32(low, casters, out)
        self._into = policy.inplace_self(casters)
        self._casters = casters
        self._fp32_names = fp32_names
        self._prepares = {}

    def _prepare(self, func):
        prepare = self._prepares.get(func)
        if prepare is None:
            name = getattr(func, "__name__", "")
            op = name[2:-2] if name.startswith("__") and name.endswith("__") else name
            if name in _UNCAST or returns_view(op) or name == "__getitem__":  # a view must stay a view
                prepare = policy.cast_nothing
            elif _writes_first(name):
                prepare = self._into
            else:
                written = writes(func, op)  # batch_norm's running statistics: never a cast copy
                if op in self._fp32_names:
                    prepare = self._fp32
                else:
                    prepare = self._lower_input if written and op in NORMALIZATIONS else self._lower
                if written:
                    prepare = policy.written_into(written, prepare, self._casters)
            self._prepares[func] = prepare
        return prepare

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        st = tls
        if st.off:  # a listed op, an FP32 module, disable_casts(): they decided
            return func(*args, **kwargs)
        a, k = self._prepare(func)(args, kwargs)
        st.off = OFF  # the outermost op decides: state.enter/leave, inlined as in wrap.py
        try:
            result = func(*a, **k)
            if not _is_compiling() and (a is not args or k is not kwargs):  # writes reach the caller's tensor
                cast_copies.write_back(a, args, k, kwargs)
            return result
        finally:
            st.off = 0


def _fp32_forward(original, cast_in, cast_out, forwards):
    def forward(self, *args, **kwargs):
        # casts are off for another reason than a module: it wins; reverted: what another library
        # captured of this forward (accelerate's hooks) runs the original
        if tls.off == OFF or not forwards.in_force:
            return original(self, *args, **kwargs)
        cast_args, cast_kwargs = cast_in(args, kwargs)
        found = enter(MODULE)
        try:
            out = original(self, *cast_args, **cast_kwargs)
            if not _is_compiling() and (cast_args is not args or cast_kwargs is not kwargs):  # input writes too
                cast_copies.write_back(cast_args, args, cast_kwargs, kwargs)
        finally:
            leave(found)
        return cast_out(out)

    return forward


def _lower_forward(original, cast_in, mode, forwards):
    def forward(self, *args, **kwargs):
        if tls.off == OFF or not forwards.in_force:
            return original(self, *args, **kwargs)
        args, kwargs = cast_in(args, kwargs)
        found = enter(0, mode)
        try:
            if found[1] is mode:  # already pushed by an enclosing BF16 module
                return original(self, *args, **kwargs)
            with mode:
                return original(self, *args, **kwargs)
        finally:
            leave(found)

    return forward


def _each_tensor(up):
    """``out`` with ``up`` applied to each of its tensors at any nesting, each container keeping its
    type: a tensor and a plain tuple or list of tensors (a rotary embedding's cos and sin) directly;
    anything else through pytree (dicts, namedtuples, ``ModelOutput``; its map costs a module entry
    some twenty frames per call), and what pytree takes for a leaf though it holds tensors (a
    dataclass, a tuple, list or dict subclass) walked field by field."""
    Tensor = torch.Tensor

    def leaf(v):
        if isinstance(v, Tensor):
            return up(v)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return _rebuilt(v, {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}, each)
        if isinstance(v, (tuple, list, dict)):  # a subclass pytree does not know
            return _rebuilt(v, dict(v.items()) if isinstance(v, dict) else dict(enumerate(v)), each)
        return v

    def each(out):
        t = type(out)
        if t is Tensor:
            return up(out)
        if t is tuple or t is list:
            for v in out:
                if type(v) is not Tensor:
                    break
            else:
                return t(map(up, out))
        return tree_map(leaf, out)

    return each


def _rebuilt(container, parts, each):
    """``container`` with ``each`` applied to its ``parts`` (field or key or index -> value), of its own
    type; the container itself where nothing changed."""
    mapped = {k: each(v) for k, v in parts.items()}
    if all(mapped[k] is v for k, v in parts.items()):
        return container
    if isinstance(container, tuple):
        new = tuple.__new__(type(container), mapped.values())
        if hasattr(container, "__dict__"):
            new.__dict__.update(container.__dict__)
        return new
    new = copy.copy(container)
    if isinstance(container, list):
        new[:] = mapped.values()
    elif isinstance(container, dict) and not dataclasses.is_dataclass(container):
        new.update(mapped)
    else:
        for name, value in mapped.items():
            try:
                setattr(new, name, value)
            except dataclasses.FrozenInstanceError:
                object.__setattr__(new, name, value)
    return new


class Forwards:
    """The forward replacements of one conversion; ``in_force`` until its revert()."""

    def __init__(self, low, casters, fp32_names):
        self.in_force = True
        to_fp32, lower = casters[torch.float32].any, dtypes.LOW

        def up(t):
            return to_fp32(t) if t.dtype in lower else t

        self._fp32_in = policy.fp32(low, casters)
        self._fp32_out = _each_tensor(up)
        self._lower_in = policy.lower_tensors(low, casters)
        self._mode = LowerMode(low, casters, fp32_names)

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
        return _fp32_forward(original, self._fp32_in, self._fp32_out, self)

    def in_lower(self, original):
        """The lower list's module rule: every op of ``original`` in the lower dtype."""
        return _lower_forward(original, self._lower_in, self._mode, self)


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
                setattr(fn, _OWN, _instance_own(entry, "forward"))
                out.append((entry, "forward", types.MethodType(fn, entry)))
                out.append(
                    (entry, "__getstate__", types.MethodType(_getstate(_instance_own(entry, "__getstate__")), entry))
                )
    return out


# on an instance entry's functions: what the instance held in its own
# __dict__ under that name before hmp (None: nothing)
_OWN = "__hmp_own__"


def _is_entry(value, module):
    return isinstance(value, types.MethodType) and value.__self__ is module and hasattr(value.__func__, _OWN)


def _instance_own(module, name):
    """What ``module`` holds in its own __dict__ under ``name`` without hmp
    (an entry of a conversion still in place is looked through)."""
    own = module.__dict__.get(name)
    return getattr(own.__func__, _OWN) if _is_entry(own, module) else own


def _getstate(own):
    """``__getstate__`` of a module with an instance entry: a copy or pickle gets the module
    without hmp (the entry names one object). Set on the instance, so classes stay untouched."""

    def __getstate__(self):
        state = own() if own is not None else type(self).__getstate__(self)
        state = dict(state)
        for name in ("forward", "__getstate__"):
            value = state.get(name)
            if _is_entry(value, self):
                previous = getattr(value.__func__, _OWN)
                if previous is None:
                    del state[name]
                else:
                    state[name] = previous
        return state

    setattr(__getstate__, _OWN, own)
    return __getstate__


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
