"""Wrapper factories: one small function per call form, kept apart from
where wrappers are installed (patch.py) and from what they cast (policy.py).

The per-call path reads one thread-local integer; everything else (policy,
dtype, in-place detection, logging) was decided when the wrapper was made.
"""

import functools
import logging
import types
import weakref

import torch
from torch.jit import _builtins as _jit_builtins

from . import errors, policy
from .resolve import ORIGINAL, unwrap
from .state import tls

log = logging.getLogger("hmp")

_to_bf16 = policy.PLAIN_CASTS[torch.bfloat16]
_to_fp32 = policy.PLAIN_CASTS[torch.float32]


def _finish(wrapper, op):
    try:
        functools.update_wrapper(wrapper, op)
    except (AttributeError, TypeError):  # some builtins lack __dict__ or names
        wrapper.__wrapped__ = op
    original = unwrap(op)
    setattr(wrapper, ORIGINAL, original)
    _script_as(wrapper, original)
    return wrapper


def _forget_builtin(key):
    _jit_builtins._get_builtin_table().pop(key, None)


def _script_as(wrapper, original):
    """Make TorchScript compile ``wrapper`` as ``original``: scripted code
    runs its ops uncast, from C++, like any call hmp cannot see.

    An original that TorchScript knows as an aten builtin (``torch.relu``,
    ``F.linear``) gets the wrapper registered as the same builtin, keyed by
    the wrapper's id and removed when the wrapper is collected (so a retired
    wrapper captured by a module stays scriptable after revert()). A Python
    original (``F.relu``) is compiled from its own source and scope through
    the ``__prepare_scriptable__`` hook torch.jit calls on functions."""
    builtin = _jit_builtins._find_builtin(original)
    if builtin is not None:
        _jit_builtins._register_builtin(wrapper, builtin)
        weakref.finalize(wrapper, _forget_builtin, id(wrapper))
    elif isinstance(original, types.FunctionType):
        wrapper.__prepare_scriptable__ = lambda: original


_PASSTHROUGH = {}  # a wrapper's free variable names -> code that only calls ``op``


def _passthrough_code(freevars):
    """Code of ``wrapper(*args, **kwargs): return op(*args, **kwargs)`` with
    exactly ``freevars`` (a function's code can only be swapped for code with
    the same free variables)."""
    code = _PASSTHROUGH.get(freevars)
    if code is None:
        names = ", ".join(freevars)
        src = (f"def make({names}):\n    def wrapper(*args, **kwargs):\n        {names}\n"
               f"        return op(*args, **kwargs)\n    return wrapper\n")
        scope = {}
        exec(compile(src, "<hmp retired wrapper>", "exec"), scope)
        code = scope["make"](*freevars).__code__
        if code.co_freevars != freevars:  # never seen; checked so a swap cannot misbind
            code = None
        _PASSTHROUGH[freevars] = code
    return code


def retire(wrapper):
    """Turn an hmp wrapper that revert() took out of torch into a plain call
    of the original: references captured while converted (``self.act =
    F.relu``) then behave as the original, at no per-call cost to live
    wrappers. Objects that are not hmp wrappers are left alone."""
    original = getattr(wrapper, ORIGINAL, None)
    code = getattr(wrapper, "__code__", None)
    if original is None or code is None or "op" not in code.co_freevars or code.co_filename != __file__:
        return
    passthrough = _passthrough_code(code.co_freevars)
    if passthrough is None:  # revert() must not fail: such a wrapper keeps its code
        return
    wrapper.__closure__[code.co_freevars.index("op")].cell_contents = original
    wrapper.__code__ = passthrough
    # pickle saves a function by name and the name now finds the original:
    # the error it raises shows this name, which says what to do
    wrapper.__qualname__ = (f"{wrapper.__qualname__} [an hmp wrapper retired by revert(): pickle the state_dict, "
                            f"or build the module after revert()]")


def wrap_simple(op, prepare, site=None):
    """Every call goes through ``prepare`` (in-place sites, ``op_wrap``).

    ``site`` (an errors.About) describes the entry point for the error
    path; the ``except`` clauses cost nothing unless the op raises."""

    def wrapper(*args, **kwargs):
        st = tls
        if st.off:
            return op(*args, **kwargs)
        a, k = prepare(args, kwargs)
        st.off = 1
        try:
            return op(*a, **k)
        except Exception as e:
            result = errors.failed(e, op, site, args, kwargs, a, k)
            if result is errors.RAISE:
                raise
            return result
        finally:
            st.off = 0

    return _finish(wrapper, op)


def wrap_call(op, prepare, prepare_out, prepare_inplace=None, inplace_param=None, site=None):
    """Out-of-place entry point. A call with ``out=`` (or ``inplace=True``
    for functions that take it) follows the in-place rule instead."""
    if inplace_param is None:

        def wrapper(*args, **kwargs):
            st = tls
            if st.off:
                return op(*args, **kwargs)
            if kwargs and kwargs.get("out") is not None:
                a, k = prepare_out(args, kwargs)
            else:
                a, k = prepare(args, kwargs)
            st.off = 1
            try:
                return op(*a, **k)
            except Exception as e:
                result = errors.failed(e, op, site, args, kwargs, a, k)
                if result is errors.RAISE:
                    raise
                return result
            finally:
                st.off = 0

    else:

        def wrapper(*args, **kwargs):
            st = tls
            if st.off:
                return op(*args, **kwargs)
            if len(args) > inplace_param:
                inplace = args[inplace_param]
            else:
                inplace = kwargs.get("inplace", False) if kwargs else False
            if inplace:
                a, k = prepare_inplace(args, kwargs)
            elif kwargs and kwargs.get("out") is not None:
                a, k = prepare_out(args, kwargs)
            else:
                a, k = prepare(args, kwargs)
            st.off = 1
            try:
                return op(*a, **k)
            except Exception as e:
                result = errors.failed(e, op, site, args, kwargs, a, k)
                if result is errors.RAISE:
                    raise
                return result
            finally:
                st.off = 0

    return _finish(wrapper, op)


def _mentions_dtype(error):
    text = str(error).lower()
    return "dtype" in text or "scalar type" in text


def mixed_or_lower(op, lower_all):
    """``op`` for a norm whose input alone was cast. Where the device's kernel
    rejects mixed dtypes, retry with weight and bias cast too, and from then
    on go straight there for that device type."""
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

    return _finish(call, op)


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

    return wrap_simple(op, prepare, errors.About(getattr(op, "__qualname__", None) or repr(op)))


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
