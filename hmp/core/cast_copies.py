"""The copies hmp casts arguments into: a finite value stays finite (``FINITE_CASTS``,
``overflow_limit``), and a write into a copy reaches the caller's tensor
(``write_back``): docs/never-changes.md. policy.py decides which arguments are cast."""

import decimal
import numbers
from typing import Callable, NamedTuple

import torch

from hmp.core import saturating_cast, torch_private
from hmp.core.dtypes import BF16, FP16, FP32, FP64
from hmp.core.dtypes import name as dtype_name
from hmp.core.state import OFF, tls

Tensor = torch.Tensor

# Casts go straight to TensorBase's C methods, never through a name hmp may
# patch (so listing `to` or `float` cannot recurse). The per-dtype methods
# parse their arguments faster than `to`; all of them are differentiable.
# _ROUNDING: torch's rounding (a value beyond the target's range is inf), where torch's own rounding
# is the contract (custom_fwd's cast_inputs) and for casts that widen (ROUNDING_CASTS, below).
_TB = torch_private.TensorBase
_ROUNDING = {FP16: _TB.half, BF16: _TB.bfloat16, FP32: _TB.float, FP64: _TB.double}

_isinf, _clamp, _where, _nan_to_num_ = torch.isinf, torch.clamp, torch.where, _TB.nan_to_num_
_aminmax, _item, _copy_ = torch.aminmax, _TB.item, _TB.copy_
_set_grad, _tracing = torch_private.set_grad_enabled, torch_private.tracing_state
_compiling = torch_private.compiling
_apply_finite, _run_finite, _Parameter = saturating_cast.apply, saturating_cast.run, torch.nn.Parameter
_transforms_active, _forward_ad_level = torch_private.functorch_transforms_active, torch_private.forward_ad_level
_grad_enabled = torch.is_grad_enabled
_NAN = float("nan")


class Cast(NamedTuple):
    """A cast in two forms: ``any(t)`` wherever a call runs (eager, traced, compiled);
    ``eager(t)`` for a wrapper's eager call, which already asked whether anything traces
    or compiles, so it asks nothing per tensor."""

    any: Callable
    eager: Callable


def _finite(dtype):
    """The cast to a lower dtype that keeps a finite value finite: torch's rounding, then a
    finite value beyond the range becomes the largest finite value; inf and NaN stay.
    Written outside autograd (the gradient is the plain cast's). On the CPU one
    ``aminmax`` says whether anything is out of range; off it the cast is one op,
    ``hmp::to_finite``; a tensor subclass, vmap and forward AD take torch's ops."""
    cast, top = _ROUNDING[dtype], torch.finfo(dtype).max

    def eager(t):
        # one frame (the lean eager path): the op's autograd and kernel calls are C calls or inlined
        if not t.is_cpu:
            tt = type(t)
            if (tt is Tensor or tt is _Parameter) and not _transforms_active() and _forward_ad_level() < 0:
                if t.requires_grad and _grad_enabled():
                    return _apply_finite(t, dtype)
                return _run_finite(t, dtype)
        y = cast(t)
        grad = y.requires_grad  # grad mode on and t requires grad: the checks run outside autograd
        if grad:
            _set_grad(False)
        try:
            if t.is_cpu:
                lo, hi = _aminmax(t)  # C methods: never a name hmp may patch (no recursion)
                if -top <= _item(lo) and _item(hi) <= top:  # NaN and infinities are not within
                    return y
            _where(_isinf(t), y, _clamp(y, -top, top), out=y)  # outside autograd: out= is fine
        except (RuntimeError, NotImplementedError):  # empty (no bound to read); a layout without these ops
            pass  # (nested): torch's rounding
        finally:
            if grad:
                _set_grad(True)
        return y

    def cast_finite(t):
        # casts off while hmp casts: a BF16 module's mode (module_rules.LowerMode) must not lower the
        # source before its range is read, nor cast what the saturation computes
        st = tls
        shield = not st.off
        if shield:
            st.off = OFF
        try:
            if _tracing() is None and not _compiling():
                return eager(t)
            y = cast(t)
            grad = y.requires_grad
            if grad:
                _set_grad(False)
            try:
                if _tracing() is not None:  # jit.trace: an op on the source would keep it alive; infinities saturate
                    _nan_to_num_(y, _NAN, top, -top)
                else:  # compiled: no bound read on the host; copy_, as dynamo takes no out= it cannot prove contiguous
                    _copy_(y, _where(_isinf(t), y, _clamp(y, -top, top)))
            except (RuntimeError, NotImplementedError):  # a layout without these ops (nested): torch's rounding
                pass
            finally:
                if grad:
                    _set_grad(True)
            return y
        finally:  # also when the cast raises (a subclass refusing the dtype): casts come back on
            if shield:
                st.off = 0

    cast_finite.__name__ = cast_finite.__qualname__ = f"to_{dtype_name(dtype)}_finite"
    eager.__name__ = eager.__qualname__ = f"to_{dtype_name(dtype)}_finite_eager"
    return Cast(cast_finite, eager)


def shielded(cast):
    """``cast`` with casts off while it runs, where they are on (its own ops are not hmp's to cast)."""

    def run(t):
        st = tls
        if st.off:
            return cast(t)
        st.off = OFF
        try:
            return cast(t)
        finally:
            st.off = 0

    return run


# The casts hmp makes: to a lower dtype, finite values stay finite.
FINITE_CASTS = {
    FP16: _finite(FP16),
    BF16: _finite(BF16),
    FP32: Cast(_TB.float, _TB.float),
    FP64: Cast(_TB.double, _TB.double),
}
# torch's rounding (a policy's argument): the rescue's cast up, custom_fwd's cast_inputs, tests
ROUNDING_CASTS = {dtype: Cast(cast, cast) for dtype, cast in _ROUNDING.items()}


# kept: a memo per Python type, written during calls; a type is a number or not for its whole life
_NUMBER_TYPES = {bool: False, type(None): False, str: False}  # type -> a real number other than bool


def is_number(t):
    """True for a real number type other than float, int and bool: numpy's
    scalars (``np.float32``, ``np.float64``), ``fractions.Fraction``,
    ``decimal.Decimal``. Decided once per type."""
    known = _NUMBER_TYPES.get(t)
    if known is None:
        known = _NUMBER_TYPES[t] = issubclass(t, (numbers.Real, decimal.Decimal)) and t is not bool
    return known


def overflow_limit(low):
    """Numbers beyond this magnitude are not finite values of ``low``: the largest finite
    value, the bound that holds whichever way a kernel rounds. The BF16 rule's check of a
    call's numbers (policy.cast_each's ``limit``): a finite one beyond it refuses the rule."""
    return torch.finfo(low).max


_version = torch_private.version_of
_no_grad = torch.no_grad


def write_back(cast_args, args, cast_kwargs, kwargs):
    """After an op ran on hmp's copies: what it wrote into a copy is written into the
    caller's tensor, catching writes no schema declares (``F.embedding``'s ``max_norm``).
    A copy was written when its version counter moved."""
    if cast_args is not args:
        _back_seq(cast_args, args)
    if cast_kwargs is not kwargs:
        for key, original in kwargs.items():
            copy = cast_kwargs.get(key)
            if copy is not original:
                _back_seq((copy,), (original,))


def _back_seq(copies, originals):
    for c, o in zip(copies, originals):
        if c is o:
            continue
        if isinstance(c, Tensor):
            try:
                written = _version(c) > 0
            except RuntimeError:  # an inference tensor keeps no version counter
                continue
            if written and isinstance(o, Tensor):
                _write_into(o, c)
        elif (type(c) is list or type(c) is tuple) and (type(o) is list or type(o) is tuple):
            _back_seq(c, o)


def _write_into(original, copy):
    """The elements of ``copy`` that differ from a fresh cast of
    ``original`` go into ``original`` (in its dtype); the others keep their
    exact value, so a write to a few rows of a cast copy rounds nothing else."""
    if copy.shape != original.shape:
        return  # resized by the op: nothing to map back element by element
    with _no_grad():
        fresh = FINITE_CASTS[copy.dtype].any(original)
        changed = copy != fresh
        if changed.any():
            original.copy_(torch.where(changed, copy.to(original.dtype), original))
