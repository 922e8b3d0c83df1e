"""Per call: a module entry's forward under its list's module rule, and the mode a BF16
module pushes while it runs. hmp/binding/modules.py builds them at convert time and decides,
at an op's first call inside a BF16 module, which rule that op gets (``LowerMode``'s
``decide``: it reads torch's schemas, which is binding's).

The innermost module policy wins; ``disable_casts()``, torch.autocast regions, backward and
an enclosing listed op win over all of them."""

import copy
import dataclasses
import types

import torch
from torch.overrides import TorchFunctionMode

from hmp.core import cast_copies
from hmp.core.state import MODULE, OFF, enter, leave, tls
from hmp.core.torch_private import tree_map

_is_compiling = torch.compiler.is_compiling


class LowerMode(TorchFunctionMode):
    """Inside a BF16 module: each op not in a listed wrapper runs under the prepare
    ``decide(func)`` gives it at its first call (kept per op for the mode's life)."""

    def __init__(self, decide):
        super().__init__()
        self._decide = decide
        self._prepares = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        st = tls
        if st.off:  # a listed op, an FP32 module, disable_casts(): they decided
            return func(*args, **kwargs)
        prepare = self._prepares.get(func)
        if prepare is None:
            prepare = self._prepares[func] = self._decide(func)
        a, k = prepare(args, kwargs)
        st.off = OFF  # the outermost op decides: state.enter/leave, inlined as in wrap.py
        try:
            result = func(*a, **k)
            if not _is_compiling() and (a is not args or k is not kwargs):  # writes reach the caller's tensor
                cast_copies.write_back(a, args, k, kwargs)
            return result
        finally:
            st.off = 0


def fp32_forward(original, cast_in, cast_out, forwards):
    """The FP32 module rule's ``forward(self, ...)``: inputs through ``cast_in``, nothing inside cast,
    outputs through ``cast_out``; ``forwards.in_force`` until the conversion's revert()."""

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


def lower_forward(original, cast_in, mode, forwards):
    """The BF16 module rule's ``forward(self, ...)``: inputs through ``cast_in``, every op inside under
    ``mode`` (a LowerMode, pushed once however deep such modules nest)."""

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


def each_tensor(up):
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


def to_float32(cast, lower):
    """The FP32 module rule's outputs: each tensor of a dtype in ``lower`` through ``cast``."""

    def up(t):
        return cast(t) if t.dtype in lower else t

    return each_tensor(up)


# on an instance entry's functions: what the instance held in its own
# __dict__ under that name before hmp (None: nothing)
OWN = "__hmp_own__"


def is_entry(value, module):
    """Whether ``value`` is an instance entry's function bound to ``module``."""
    return isinstance(value, types.MethodType) and value.__self__ is module and hasattr(value.__func__, OWN)


def getstate(own):
    """``__getstate__`` of a module with an instance entry: a copy or pickle gets the module
    without hmp (the entry names one object). Set on the instance, so classes stay untouched."""

    def __getstate__(self):
        state = own() if own is not None else type(self).__getstate__(self)
        state = dict(state)
        for name in ("forward", "__getstate__"):
            value = state.get(name)
            if is_entry(value, self):
                previous = getattr(value.__func__, OWN)
                if previous is None:
                    del state[name]
                else:
                    state[name] = previous
        return state

    setattr(__getstate__, OWN, own)
    return __getstate__
