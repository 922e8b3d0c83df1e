"""Custom autograd Functions made AMP-safe the documented way (``torch.amp.custom_fwd``
/ ``custom_bwd``): hmp honours the author's decorators as torch.autocast does.

- ``custom_fwd(cast_inputs=dtype)``: while hmp casts, the floating inputs (float64
  aside) go to ``dtype`` and the forward runs with casts off.
- ``custom_bwd``: the backward runs in the cast state its forward ran in.

Only decorated Functions are touched: such a class (and, for ``custom_bwd``, its
backward node class) gets an ``apply`` of its own around the one it would call;
``Function.apply`` and ``BackwardCFunction.apply`` stay torch's. Classes existing at
convert() are found among Function's subclasses; later ones through an ``__init__``
on ``FunctionMeta``, which runs once per class creation (docs/decisions.md says why
this hook). Every patch goes through the patch log; revert() restores each class's
``__dict__``."""

import inspect
import weakref

import torch

from hmp.binding.resolve import subclasses
from hmp.core import torch_private
from hmp.core.cast_copies import ROUNDING_CASTS
from hmp.core.dtypes import FLOATS, FP64
from hmp.core.identity import mark, stand_in, unwrap
from hmp.core.policy import cast_kwargs, cast_seq
from hmp.core.state import OFF, current, enter, leave, tls
from hmp.core.switches import run_as
from hmp.rules.interface import Changes

_Function = torch.autograd.Function
_Meta = torch_private.FunctionMeta
_FORWARD_STATE = "_hmp_forward_state"  # on a ctx: (cast state of its forward, undecorated backward)

# Function class -> (dtypes cast_inputs casts, its cast; or None, None), custom_bwd's backward or None
# kept: what an autograd Function class declares with custom_fwd/custom_bwd (weak: goes with it)
_declarations = weakref.WeakKeyDictionary()


def _declared(cls):
    """What ``cls`` declares with custom_fwd/custom_bwd (memoized)."""
    found = _declarations.get(cls)
    if found is None:
        cast = torch_private.custom_fwd_cast(getattr(cls, "forward", None))
        if cast:
            found = (FLOATS - {cast, FP64}, ROUNDING_CASTS[cast].any, None)
        else:
            found = (None, None, torch_private.custom_bwd_inner(getattr(cls, "backward", None)))
        _declarations[cls] = found
    return found


def _mark(out, state, backward):
    """Give the Function's ctx (its outputs' grad_fn) what its backward needs."""
    for t in out if isinstance(out, tuple) else (out,):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            setattr(t.grad_fn, _FORWARD_STATE, (state, backward))
            return


def _apply(descriptor):
    """``apply`` honouring the decorators of the class it is called on;
    ``descriptor`` is the one that class calls without hmp (torch's own: a
    Python classmethod up to 2.13, a C classmethod descriptor in 2.14)."""

    def original(cls, *args, **kwargs):
        return descriptor.__get__(None, cls)(*args, **kwargs)

    def apply(cls, *args, **kwargs):
        st = tls
        if st.off:
            return original(cls, *args, **kwargs)
        src, to, backward = _declared(cls)
        if src is not None:
            args = cast_seq(args, src, to)
            if kwargs:
                kwargs = cast_kwargs(kwargs, src, to)
            found = enter(OFF)
            try:
                return original(cls, *args, **kwargs)
            finally:
                leave(found)
        out = original(cls, *args, **kwargs)
        if backward is not None:
            _mark(out, current(), backward)
        return out

    apply.__name__ = apply.__qualname__ = "apply"
    apply.__doc__ = getattr(descriptor, "__doc__", None)
    return mark(apply, descriptor)  # not stand_in: a classmethod descriptor has no name to copy


def _backward_apply(original):
    def apply(self, *args):
        marked = getattr(self, _FORWARD_STATE, None)
        if marked is None:
            return original(self, *args)
        state, backward = marked
        # custom_bwd's own wrapper only enters an autocast region, disabled
        # here: hmp's forward ran outside any, so it is skipped
        return run_as(backward, state)(self, *args)

    return stand_in(apply, original)


def _torch_apply(cls):
    """The ``apply`` descriptor ``cls`` calls without hmp (a conversion still
    in place: the one hmp's wraps)."""
    found = inspect.getattr_static(cls, "apply")
    func = getattr(found, "__func__", None)
    original = unwrap(func)
    return found if original is func else original


def class_patches(cls):
    """``[(namespace, attr, value)]`` for one Function class: [] unless it
    carries ``custom_fwd(cast_inputs=...)`` or ``custom_bwd``."""
    src, _, backward = _declared(cls)
    if src is None and backward is None:
        return []
    out = [(cls, "apply", classmethod(_apply(_torch_apply(cls))))]
    node = torch_private.backward_class(cls) if backward is not None else None
    if node is not None:
        out.append((node, "apply", _backward_apply(unwrap(inspect.getattr_static(node, "apply")))))
    return out


def _patch_new_class(cls, hook, later):
    """A Function class created while converted: its patches, through the log."""
    if _Meta.__dict__.get("__init__") is not hook:  # reverted meanwhile
        return
    for namespace, attr, value in class_patches(cls):
        later(namespace, attr, value)


def _class_created(original, later):
    def __init__(cls, *args, **kwargs):
        original(cls, *args, **kwargs)
        if issubclass(cls, _Function) and _declared(cls) != (None, None, None):
            _patch_new_class(cls, __init__, later)

    return stand_in(__init__, original)


def changes(ctx):
    """The rule's changes (hmp/rules/interface.py): ``apply`` of each decorated
    Function class and of its backward node class, and the class-creation hook."""
    out = [p for cls in dict.fromkeys(subclasses(_Function)) for p in class_patches(cls)]
    init = _class_created(unwrap(inspect.getattr_static(_Meta, "__init__")), ctx.later)
    out.append((_Meta, "__init__", init))
    return Changes(tuple(out))
