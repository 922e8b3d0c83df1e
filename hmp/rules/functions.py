"""Custom autograd Functions made AMP-safe the documented way
(``torch.amp.custom_fwd`` / ``custom_bwd``): hmp honours the author's
decorators as torch.autocast does, instead of casting inside them.

- ``custom_fwd(cast_inputs=dtype)``: while hmp casts, the Function's
  floating tensor inputs (float64 aside, as in torch) go to ``dtype`` and
  its forward runs with casts off. Its backward is uncast, like all of
  backward, so both compute in ``dtype``.
- ``custom_bwd`` (forward without ``cast_inputs``): the backward runs in the
  cast state its forward ran in, instead of uncast like the rest of
  backward, so it computes in the dtypes its forward's ops gave.

What a Function class declares is read once per class; a Function without
the decorators costs one dictionary lookup per ``apply``.
"""

import weakref

import torch

from hmp.core import torch_private
from hmp.core.casts import run_as
from hmp.core.policy import FLOATS, FP64, PLAIN_CASTS, cast_kwargs, cast_seq
from hmp.core.resolve import ORIGINAL, stand_in, unwrap
from hmp.core.state import OFF, current, enter, leave, tls

_Function = torch.autograd.Function
_Backward = torch_private.BackwardCFunction
_FORWARD_STATE = "_hmp_forward_state"  # on a ctx: (cast state of its forward, undecorated backward)

# Function class -> (dtypes cast_inputs casts, its cast; or None, None), custom_bwd's backward or None
_plans = weakref.WeakKeyDictionary()


def _plan(cls):
    plan = _plans.get(cls)
    if plan is None:
        cast = torch_private.custom_fwd_cast(getattr(cls, "forward", None))
        if cast:
            plan = (FLOATS - {cast, FP64}, PLAIN_CASTS[cast], None)
        else:
            plan = (None, None, torch_private.custom_bwd_inner(getattr(cls, "backward", None)))
        _plans[cls] = plan
    return plan


def _mark(out, state, backward):
    """Give the Function's ctx (its outputs' grad_fn) what its backward needs."""
    for t in out if isinstance(out, tuple) else (out,):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            setattr(t.grad_fn, _FORWARD_STATE, (state, backward))
            return


def _apply(descriptor):
    """``Function.apply`` honouring the decorators; ``descriptor`` is torch's
    own (a Python classmethod up to 2.13, a C classmethod descriptor in 2.14)."""

    def original(cls, *args, **kwargs):
        return descriptor.__get__(None, cls)(*args, **kwargs)

    def apply(cls, *args, **kwargs):
        st = tls
        if st.off:
            return original(cls, *args, **kwargs)
        src, to, backward = _plan(cls)
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
    setattr(apply, ORIGINAL, descriptor)
    return apply


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


def patches(ctx):
    """``[(namespace, attr, value)]``: Function.apply and the backward's apply."""
    own = _Function.__dict__["apply"]
    installed = getattr(own, "__func__", None)  # hmp's classmethod, from a conversion still in place
    descriptor = getattr(installed, ORIGINAL, own)
    return [
        (_Function, "apply", classmethod(_apply(descriptor))),
        (_Backward, "apply", _backward_apply(unwrap(_Backward.__dict__["apply"]))),
    ]
