"""The wrappers: small bodies for every call hmp casts (listed ops,
registered functions, ``@hmp.*_function`` decorators, ``op_wrap``), and
``Wrappers``, the one place where a site's body and policy are chosen.

Per call a body reads the thread's ``off``; when it is 0 it casts the
arguments by the site's policy (chosen at convert time), turns casts off
for the op's duration (the outermost op decides: hmp/state.py's
``enter``/``leave``, inlined, since a body only gets there when ``off`` is
0) and on an exception hands over to hmp/fallback.py.

The general body calls the site's ``prepare`` (hmp/policy.py). The lean
bodies (BF16, FP32 and promote rules) apply the same rule inline to a call
without keyword arguments, the common case, and call ``prepare`` for the
rest: one function call less per call, and a call with nothing to cast
leaves after one dtype check per tensor argument. ``prepare`` is None in a
paused or retired wrapper: a plain call of ``op``.
"""

import functools
import logging
import types
import weakref

import torch

from . import culprit, fallback, policy, torch_private
from .errors import Wrapped
from .resolve import ORIGINAL, unwrap
from .state import OFF, tls

log = logging.getLogger("hmp")

_to_bf16 = policy.PLAIN_CASTS[torch.bfloat16]
_to_fp32 = policy.PLAIN_CASTS[torch.float32]
_Tensor, _FP32, _FLOATS = torch.Tensor, policy.FP32, policy.FLOATS
_NEVER = 1 << 62  # inplace_at of a site without an ``inplace`` parameter


def make(op, prepare, wrapped, original=None):
    """The general wrapper of ``op``: casts through ``prepare``; ``wrapped`` (an
    errors.Wrapped) describes it for the error path. ``original``: what ``op``
    adapts, when it is an adapter (wrapper attributes come from it)."""
    return _finish(_body(op, prepare, wrapped), op if original is None else original)


def _body(op, prepare, wrapped):
    def wrapper(*args, **kwargs):
        st = tls
        if st.off or prepare is None:
            return op(*args, **kwargs)
        a, k = prepare(args, kwargs)
        st.off = OFF
        try:
            return op(*a, **k)
        except Exception as e:  # costs nothing unless the op raises
            result = fallback.rescue(e, op, wrapped, args, kwargs, a, k)
            if result is fallback.RAISE:
                raise
            return result
        finally:
            st.off = 0

    return wrapper


def _lower_body(op, prepare, wrapped, cast, refuse, inplace_at):
    """The BF16 rule (policy.lower) inline: float32 tensors to the lower
    dtype; a number ``refuse`` rejects sends the call to ``prepare``."""

    def wrapper(*args, **kwargs):
        st = tls
        if st.off or prepare is None:
            return op(*args, **kwargs)
        if kwargs or len(args) > inplace_at and args[inplace_at]:
            a, k = prepare(args, kwargs)
        else:
            a, k = args, kwargs
            for i, v in enumerate(args):
                if isinstance(v, _Tensor):
                    if v.dtype is _FP32:
                        if a is args:
                            a = list(args)
                        a[i] = cast(v)
                elif type(v) is float or type(v) is int:
                    if refuse(v):
                        a, k = prepare(args, kwargs)
                        break
                elif type(v) is list or type(v) is tuple:
                    b = policy.cast_seq(v, policy.FP32_ONLY, cast)
                    if b is not v:
                        if a is args:
                            a = list(args)
                        a[i] = b
        st.off = OFF
        try:
            return op(*a, **k)
        except Exception as e:
            result = fallback.rescue(e, op, wrapped, args, kwargs, a, k)
            if result is fallback.RAISE:
                raise
            return result
        finally:
            st.off = 0

    return wrapper


def _upper_body(op, prepare, wrapped, cast, inplace_at):
    """The FP32 rule (policy.fp32) inline: bfloat16 and float16 tensors to float32."""
    src = policy.HALVES

    def wrapper(*args, **kwargs):
        st = tls
        if st.off or prepare is None:
            return op(*args, **kwargs)
        if kwargs or len(args) > inplace_at and args[inplace_at]:
            a, k = prepare(args, kwargs)
        else:
            a, k = args, kwargs
            for i, v in enumerate(args):
                if isinstance(v, _Tensor):
                    if v.dtype in src:
                        if a is args:
                            a = list(args)
                        a[i] = cast(v)
                elif type(v) is list or type(v) is tuple:
                    b = policy.cast_seq(v, src, cast)
                    if b is not v:
                        if a is args:
                            a = list(args)
                        a[i] = b
        st.off = OFF
        try:
            return op(*a, **k)
        except Exception as e:
            result = fallback.rescue(e, op, wrapped, args, kwargs, a, k)
            if result is fallback.RAISE:
                raise
            return result
        finally:
            st.off = 0

    return wrapper


def _promote_body(op, prepare, wrapped, inplace_at):
    """The promote rule (policy.promote) with its common case inline: the
    floating tensors (top level, or in a list/tuple argument) share one
    dtype, so nothing is cast; any other call goes to ``prepare``."""

    def wrapper(*args, **kwargs):
        st = tls
        if st.off or prepare is None:
            return op(*args, **kwargs)
        a, k = args, kwargs
        if kwargs or len(args) > inplace_at and args[inplace_at]:
            a, k = prepare(args, kwargs)
        else:
            seen = None
            for v in args:
                if isinstance(v, _Tensor):
                    d = v.dtype
                    if d in _FLOATS:
                        if seen is None:
                            seen = d
                        elif d is not seen:
                            a, k = prepare(args, kwargs)
                            break
                elif type(v) is list or type(v) is tuple:
                    d = policy.one_dtype(v, seen)
                    if d is False:
                        a, k = prepare(args, kwargs)
                        break
                    seen = d
        st.off = OFF
        try:
            return op(*a, **k)
        except Exception as e:
            result = fallback.rescue(e, op, wrapped, args, kwargs, a, k)
            if result is fallback.RAISE:
                raise
            return result
        finally:
            st.off = 0

    return wrapper


def _op_of(frame):
    return frame.f_locals.get("op")


BODIES = frozenset(f.__code__ for f in (
    _body(None, None, None), _lower_body(None, None, None, None, None, None),
    _upper_body(None, None, None, None, None), _promote_body(None, None, None, None)))
for _code in BODIES:
    culprit.register_wrapper(_code, _op_of)


def _finish(wrapper, op):
    try:
        functools.update_wrapper(wrapper, op)
    except (AttributeError, TypeError):  # some builtins lack __dict__ or names
        wrapper.__wrapped__ = op
    original = unwrap(op)
    setattr(wrapper, ORIGINAL, original)
    _script_as(wrapper, original)
    return wrapper


_forget_builtin = torch_private.jit_forget_builtin


def _script_as(wrapper, original):
    """Make TorchScript compile ``wrapper`` as ``original``: scripted code
    runs its ops uncast, from C++, like any call hmp cannot see.

    An original that TorchScript knows as an aten builtin (``torch.relu``,
    ``F.linear``) gets the wrapper registered as the same builtin, keyed by
    the wrapper's id and removed when the wrapper is collected (so a retired
    wrapper captured by a module stays scriptable after revert()). A Python
    original (``F.relu``) is compiled from its own source and scope through
    the ``__prepare_scriptable__`` hook torch.jit calls on functions."""
    builtin = torch_private.jit_find_builtin(original)
    if builtin is not None:
        torch_private.jit_register_builtin(wrapper, builtin)
        weakref.finalize(wrapper, _forget_builtin, id(wrapper))
    elif isinstance(original, types.FunctionType):
        wrapper.__prepare_scriptable__ = lambda: original


def _cell(wrapper, name):
    return wrapper.__closure__[wrapper.__code__.co_freevars.index(name)]


def is_wrapper(obj):
    return getattr(obj, "__code__", None) in BODIES


def pause(wrapper):
    """Make a wrapper a plain call of what it wraps (its ``prepare`` None)."""
    _cell(wrapper, "prepare").cell_contents = None


def resume(wrapper, prepare):
    """Make a paused general wrapper cast again, through ``prepare``."""
    _cell(wrapper, "prepare").cell_contents = prepare


def retire(wrapper):
    """Turn a wrapper that revert() took out of torch into a plain call of
    the original: references captured while converted (``self.act =
    F.relu``) then behave as the original. Objects that are not hmp
    wrappers are left alone."""
    original = getattr(wrapper, ORIGINAL, None)
    if original is None or not is_wrapper(wrapper):
        return
    _cell(wrapper, "op").cell_contents = original
    pause(wrapper)
    # pickle saves a function by name and the name now finds the original:
    # the error it raises shows this name, which says what to do
    wrapper.__qualname__ = (f"{wrapper.__qualname__} [an hmp wrapper retired by revert(): pickle the state_dict, "
                            f"or build the module after revert()]")


def _mentions_dtype(error):
    text = str(error).lower()
    return "dtype" in text or "scalar type" in text


def mixed_or_lower(op, lower_all):
    """``op`` for a norm whose input alone was cast. Where the device's kernel
    rejects mixed dtypes, retry with weight and bias cast too, and from then
    on go straight there for that device type."""
    return _finish(_mixed_or_lower(op, lower_all), op)


def _mixed_or_lower(op, lower_all):
    unsupported = set()

    def call(*args, **kwargs):
        x = args[0] if args else kwargs.get("input")
        device = x.device.type if isinstance(x, torch.Tensor) else None
        if device in unsupported:
            args, kwargs = lower_all(args, kwargs)
            return op(*args, **kwargs)
        try:
            return op(*args, **kwargs)
        except RuntimeError as e:
            if not _mentions_dtype(e):
                raise
            cast_args, cast_kwargs = lower_all(args, kwargs)
            if cast_args is args and cast_kwargs is kwargs:
                raise  # nothing left to cast: not a mixed-dtype problem
            result = op(*cast_args, **cast_kwargs)
            unsupported.add(device)
            log.info("hmp: %s rejects mixed dtypes on %s; casting weight and bias too", getattr(op, "__name__", op), device)
            return result

    return call


culprit.register_wrapper(_mixed_or_lower(None, None).__code__, _op_of)


def _dtypes(args, kwargs):
    out = []

    def visit(v):
        if isinstance(v, torch.Tensor):
            out.append(str(v.dtype).replace("torch.", ""))
        elif type(v) is list or type(v) is tuple:
            for x in v:
                visit(x)

    visit(args)
    if kwargs:
        visit(tuple(kwargs.values()))
    return out


def logged(prepare, label):
    """``prepare`` that also logs the op, its input dtypes and what it ran in."""

    def verbose_prepare(args, kwargs):
        before = _dtypes(args, kwargs)
        args, kwargs = prepare(args, kwargs)
        log.debug("hmp: %s inputs (%s) -> (%s)", label, ", ".join(before), ", ".join(_dtypes(args, kwargs)))
        return args, kwargs

    return verbose_prepare


class Wrappers:
    """What every wrapper of one conversion does, decided per site.

    ``casters``: dtype -> cast function (plain or through the weight cache);
    ``verbose`` logs every cast call; ``recorder`` (hmp/record.py)
    instruments the wrappers for profile/audit/tune; ``passthrough`` makes
    them cast nothing while still recording (an audit's fp32 reference).
    """

    def __init__(self, low, casters, verbose=False, recorder=None, passthrough=False):
        self.low, self.casters, self.verbose, self.recorder, self.passthrough = low, casters, verbose, recorder, passthrough

    def _prepare(self, prepare, label, name):
        if self.passthrough:
            prepare = policy.cast_nothing
        if self.verbose:
            prepare = logged(prepare, label)
        if self.recorder is not None:
            prepare = self.recorder.prepare(prepare, name)
        return prepare

    def _op(self, op):
        return op if self.recorder is None else self.recorder.op(op)

    def site(self, binding, original):
        """The wrapper of ``original`` for a resolve.Binding."""
        site, kind, name = binding
        prepare = policy.for_site(kind, name, site, self.low, self.casters)
        op = original
        if policy.rejects_mixed(kind, name) and not self.passthrough:
            op = mixed_or_lower(op, policy.lower(self.low, self.casters))
        wrapped = Wrapped.of(binding)
        op = self._op(op)
        if self.passthrough or self.verbose or self.recorder is not None or site.inplace \
                or name in policy.NORM_OPS and kind == "bf16":
            return make(op, self._prepare(prepare, site.label, name), wrapped, original)
        # a lean body: the same rule as ``prepare``, inline for calls without keywords
        at = _NEVER if site.inplace_param is None else site.inplace_param
        if kind == "bf16":
            body = _lower_body(op, prepare, wrapped, self.casters[self.low], policy.numbers_check(self.low, name), at)
        elif kind == "fp32":
            body = _upper_body(op, prepare, wrapped, self.casters[_FP32], at)
        else:
            body = _promote_body(op, prepare, wrapped, at)
        return _finish(body, original)

    def user_prepare(self, kind, label):
        """The prepare of a user function (``@hmp.*_function``) of list ``kind``."""
        return self._prepare(policy.for_kind(kind, self.low, self.casters), label, f"user_{kind}_function")


def user_function(fn, kind):
    """The wrapper ``@hmp.{kind}_function`` returns; paused until convert()
    resumes it with that conversion's prepare."""
    label = getattr(fn, "__qualname__", None) or repr(fn)
    return make(fn, None, Wrapped(label, None, kind))  # paused: prepare None


def op_wrap(op, cast_fn):
    """Habana's public helper: a wrapper of ``op`` that passes every tensor
    argument (positional, keyword, or inside a list/tuple) through
    ``cast_fn`` before calling it. It follows ``disable_casts`` and the
    outermost-op rule like every hmp wrapper, converted or not."""

    def cast_value(v):
        if isinstance(v, torch.Tensor):
            return cast_fn(v)
        if type(v) is list or type(v) is tuple:
            return type(v)(cast_value(x) for x in v)
        return v

    def prepare(args, kwargs):
        return tuple(cast_value(a) for a in args), {k: cast_value(v) for k, v in kwargs.items()}

    return make(op, prepare, Wrapped(getattr(op, "__qualname__", None) or repr(op)))


def to_bf16(t):
    """Cast a float32 tensor to bfloat16; anything else is returned as is."""
    if isinstance(t, torch.Tensor) and t.dtype is torch.float32:
        return _to_bf16(t)
    return t


def to_fp32(t):
    """Cast a bfloat16/float16 tensor to float32; anything else is returned as is."""
    if isinstance(t, torch.Tensor) and (t.dtype is torch.bfloat16 or t.dtype is torch.float16):
        return _to_fp32(t)
    return t
