"""The copies hmp casts arguments into.

Made so that a finite value stays finite (``CASTS``; and ``numbers_check``,
the BF16 rule's test of a Python number against the lower dtype's range),
and a write an op makes into one carried back to the caller's tensor
(``write_back``): docs/never-changes.md. The policies (policy.py) decide
which arguments are cast; this module says what a cast is.
"""

import decimal
import numbers

import torch

from hmp.core import torch_private
from hmp.core.dtypes import BF16, FP16, FP32, FP64
from hmp.core.dtypes import name as dtype_name
from hmp.core.state import OFF, tls

Tensor = torch.Tensor

# Casts go straight to TensorBase's C methods, never through a name hmp may
# patch (so listing `to` or `float` cannot recurse). The per-dtype methods
# parse their arguments faster than `to`; all of them are differentiable.
# PLAIN_CASTS round as torch does (a value beyond the target's range is inf);
# they are used where torch's own rounding is the contract (custom_fwd's
# cast_inputs) and for casts that widen.
_TB = torch_private.TensorBase
PLAIN_CASTS = {FP16: _TB.half, BF16: _TB.bfloat16, FP32: _TB.float, FP64: _TB.double}

_isinf, _clamp, _where, _nan_to_num_ = torch.isinf, torch.clamp, torch.where, _TB.nan_to_num_
_aminmax, _bump, _numel, _item = torch.aminmax, torch.autograd.graph.increment_version, _TB.numel, _TB.item
_set_grad, _grad_on, _tracing = torch_private.set_grad_enabled, torch.is_grad_enabled, torch_private.tracing_state
_compiling = torch_private.compiling
_NAN = float("nan")


def _within(t, top):
    """True when every value of ``t`` (on the CPU, where reading a bound costs
    no device sync) lies within ``[-top, top]``: one reduction, against the three
    passes saturation takes. NaN and infinities are not within."""
    if not _numel(t):
        return True
    lo, hi = _aminmax(t)
    return -top <= _item(lo) and _item(hi) <= top  # C methods: never a name hmp may patch (no recursion)


def _finite(dtype):
    """The cast to a lower dtype that keeps a finite value finite
    (docs/never-changes.md): torch's rounding, then a finite value beyond the
    dtype's range (inf after rounding) becomes its largest finite value, as
    saturating conversions do; an infinity stays infinite and NaN stays NaN,
    as in plain torch. Written into the copy outside autograd (the copy's
    gradient is the plain cast's), so the copy is the only tensor kept. It
    bumps the copy's version once (``written`` relies on that)."""
    cast, top = PLAIN_CASTS[dtype], torch.finfo(dtype).max

    def cast_finite(t):
        # casts off while hmp casts: a BF16 module's mode (modules.LowerMode) must not lower the
        # source before its range is read, nor cast what the saturation computes
        st = tls
        shield = not st.off
        if shield:
            st.off = OFF
        try:
            y = cast(t)
            grad = _grad_on() and y.requires_grad
            if grad:
                _set_grad(False)
            try:
                if _tracing() is not None:  # jit.trace: an op on the source would keep it alive; infinities saturate
                    _nan_to_num_(y, _NAN, top, -top)
                elif t.is_cpu and not _compiling() and _within(t, top):
                    _bump(y)  # nothing to saturate; the copy's version moves once either way
                else:  # outside autograd: out= is fine
                    _where(_isinf(t), y, _clamp(y, -top, top), out=y)
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
    return cast_finite


# The casts hmp makes: to a lower dtype, finite values stay finite.
CASTS = {FP16: _finite(FP16), BF16: _finite(BF16), FP32: _TB.float, FP64: _TB.double}


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
    """Numbers beyond this magnitude are not finite values of ``low``. (The
    exact point where rounding reaches inf lies a little above it, and
    moves when a kernel rounds through float32 first: the largest finite
    value is the bound that holds for every kernel.)"""
    return torch.finfo(low).max


_INF = float("inf")


def numbers_check(low):
    """The BF16 rule's check of a number: True (refuse the rule: the call
    runs under the FP32 rule) for a finite number beyond the lower dtype's
    largest value."""
    limit = overflow_limit(low)

    def refuse(a):
        return (a > limit or a < -limit) and a != _INF and a != -_INF

    return refuse


_version = torch_private.version_of
_no_grad = torch.no_grad


def write_back(cast_args, args, cast_kwargs, kwargs):
    """After an op ran on hmp's copies of its arguments: what it wrote into
    a copy is written into the caller's tensor, element by element (a
    written argument is the caller's tensor: docs/never-changes.md). This
    catches writes no schema declares (``F.embedding``'s ``max_norm``
    renormalises the weight it is given). A copy was written when its
    version counter moved past the cast's own (``_finite`` bumps it once)."""
    if cast_args is not args:
        _back_seq(cast_args, args)
    if cast_kwargs is not kwargs:
        for key, original in kwargs.items():
            copy = cast_kwargs.get(key)
            if copy is not original:
                _back_seq((copy,), (original,))


_CAST_VERSION = {BF16: 1, FP16: 1, FP32: 0, FP64: 0}  # a fresh copy's version: _finite bumps it once


def _back_seq(copies, originals):
    for c, o in zip(copies, originals):
        if c is o:
            continue
        if isinstance(c, Tensor):
            try:
                written = _version(c) > _CAST_VERSION.get(c.dtype, 0)
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
        fresh = CASTS[copy.dtype](original)
        changed = copy != fresh
        if changed.any():
            original.copy_(torch.where(changed, copy.to(original.dtype), original))
