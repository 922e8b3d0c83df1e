"""The wrapper: one body for every call hmp casts (listed ops, registered
functions, ``@hmp.*_function`` decorators, ``op_wrap``), and ``Wrappers``,
the one place where what a site's wrapper does is decided.

Per call the body reads the thread's ``off``; when it is 0 it calls
``prepare`` (the site's policy, chosen at convert time), turns casts off
for the op's duration (the outermost op decides), and on an exception hands
over to hmp/fallback.py. Everything else was decided when the wrapper was
made.
"""

import functools
import logging
import types
import weakref

import torch

from . import culprit, fallback, policy, torch_private
from .errors import About
from .resolve import ORIGINAL, unwrap
from .state import tls

log = logging.getLogger("hmp")

_to_bf16 = policy.PLAIN_CASTS[torch.bfloat16]
_to_fp32 = policy.PLAIN_CASTS[torch.float32]


def make(op, prepare, about, original=None):
    """The wrapper of ``op``: casts through ``prepare``; ``about`` (an
    errors.About) describes it for the error path. ``original``: what ``op``
    adapts, when it is an adapter (wrapper attributes come from it)."""
    return _finish(_body(op, prepare, about), op if original is None else original)


def _body(op, prepare, about):
    def wrapper(*args, **kwargs):
        st = tls
        if st.off:
            return op(*args, **kwargs)
        a, k = prepare(args, kwargs)
        st.off = 1
        try:
            return op(*a, **k)
        except Exception as e:  # costs nothing unless the op raises
            result = fallback.rescue(e, op, about, args, kwargs, a, k)
            if result is fallback.RAISE:
                raise
            return result
        finally:
            st.off = 0

    return wrapper


def _op_of(frame):
    return frame.f_locals.get("op")


_BODY = _body(None, None, None).__code__
culprit.register_wrapper(_BODY, _op_of)


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


def _passthrough_code():
    """Code of ``wrapper(*args, **kwargs): return op(*args, **kwargs)`` with
    the body's free variables (a function's code can only be swapped for
    code with the same free variables)."""
    names = ", ".join(_BODY.co_freevars)
    src = (f"def make({names}):\n    def wrapper(*args, **kwargs):\n        {names}\n"
           f"        return op(*args, **kwargs)\n    return wrapper\n")
    scope = {}
    exec(compile(src, "<hmp wrapper, not casting>", "exec"), scope)
    code = scope["make"](*_BODY.co_freevars).__code__
    assert code.co_freevars == _BODY.co_freevars
    return code


_PASSTHROUGH = _passthrough_code()


def _cell(wrapper, name):
    return wrapper.__closure__[wrapper.__code__.co_freevars.index(name)]


def is_wrapper(obj):
    return getattr(obj, "__code__", None) in (_BODY, _PASSTHROUGH)


def pause(wrapper):
    """Make a wrapper a plain call of what it wraps, at no per-call cost."""
    wrapper.__code__ = _PASSTHROUGH


def resume(wrapper, prepare):
    """Make a paused wrapper cast again, through ``prepare``."""
    _cell(wrapper, "prepare").cell_contents = prepare
    wrapper.__code__ = _BODY


def retire(wrapper):
    """Turn a wrapper that revert() took out of torch into a plain call of
    the original: references captured while converted (``self.act =
    F.relu``) then behave as the original, at no per-call cost to live
    wrappers. Objects that are not hmp wrappers are left alone."""
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

    ``casts``: dtype -> cast function (plain or through the weight cache);
    ``verbose`` logs every cast call; ``recorder`` (hmp/record.py)
    instruments the wrappers for profile/audit/tune; ``passthrough`` makes
    them cast nothing while still recording (an audit's fp32 reference).
    """

    def __init__(self, low, casts, verbose=False, recorder=None, passthrough=False):
        self.low, self.casts, self.verbose, self.recorder, self.passthrough = low, casts, verbose, recorder, passthrough

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
        prepare = self._prepare(policy.for_site(kind, name, site, self.low, self.casts), site.label, name)
        op = original
        if policy.rejects_mixed(kind, name) and not self.passthrough:
            op = mixed_or_lower(op, policy.lower(self.low, self.casts))
        about = About(site.label, name, kind, site.inplace, site.inplace_param)
        return make(self._op(op), prepare, about, original)

    def user_prepare(self, kind, label):
        """The prepare of a user function (``@hmp.*_function``) of list ``kind``."""
        return self._prepare(policy.for_kind(kind, self.low, self.casts), label, f"user_{kind}_function")


def user_function(fn, kind):
    """The wrapper ``@hmp.{kind}_function`` returns; paused until convert()
    resumes it with that conversion's prepare."""
    label = getattr(fn, "__qualname__", None) or repr(fn)
    wrapper = make(fn, policy.cast_nothing, About(label, None, kind))
    pause(wrapper)
    return wrapper


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

    return make(op, prepare, About(getattr(op, "__qualname__", None) or repr(op)))


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
