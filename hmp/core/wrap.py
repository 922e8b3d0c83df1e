"""The wrapper's body: one Python closure (``_body``) for every call hmp casts (listed
ops, registered functions, ``@hmp.*_function``, ``op_wrap``). Its life (made, paused,
resumed, retired, scripted as its original) is hmp/binding/wrapper_life.py's.

Per call, when the thread's ``off`` is 0, the body asks once whether anything
compiles or traces, turns casts off for the casts and the op (the outermost op
decides), casts the arguments by the site's rule and hands an exception to
rescue.py. A call without keywords takes the lean path (``policy.cast_each`` or
the promote check); every other call goes through the site's ``prepare``.
What each site's wrapper does is decided in hmp/binding/sites.py."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from hmp.core import cast_copies, delegation, policy, rescue, torch_private, wrapper_frames
from hmp.core.state import OFF, graph_off, tls, weight_cache

NEVER = 1 << 62  # inplace_at of a site without an ``inplace`` parameter
PAUSED = None  # a wrapper's prepare while paused or retired: the call is a plain call of its op
_cast_each, _SAME, _one_dtype, _write_back = policy.cast_each, policy.SAME, policy.one_dtype, cast_copies.write_back
_PROMOTE = policy.PROMOTE
_graph_off = graph_off
_pause, _resume, _as_torch = delegation.pause, delegation.resume, delegation.as_torch
_dynamo_compiling, _after_dynamo = torch_private.dynamo_compiling, torch_private.after_dynamo
_compile_flag, _tracing_state = torch_private.compile_flag, torch_private.tracing_state
_COMPILING, _DYNAMO, _LOWERING = torch_private.COMPILING, torch_private.DYNAMO, torch_private.LOWERING


class Spec(NamedTuple):
    """What a wrapper does: one frozen record, held by the body in one cell (as a plain tuple,
    which a call unpacks at C speed) and changed only whole (binding/wrapper_life.py's ``swap``).

    ``op``: what it calls; ``prepare(args, kwargs) -> (args, kwargs)``: the rule, or PAUSED (a
    plain call); ``about``: a rescue.About for the error path; ``src``, ``cast_any``/``eager``
    (a cast_copies.Cast's two forms), ``limit``, ``inplace_at``: the lean path for calls without
    keywords (tensors of a dtype in ``src`` go through the cast; ``src=policy.PROMOTE`` runs a
    one-dtype call as given); ``hidden``: ``op`` may write an argument undeclared (a Python
    function), so writes into cast copies are carried back; ``needs(args, kwargs)``: False for
    a call left alone; ``eager_prepare``: ``prepare`` on the casters' eager forms; ``lowers``:
    while torch.compile lowers a captured graph the op runs as torch's (not an operator, ``a @
    b``, which dynamo records as Python's, never as this wrapper)."""

    op: Callable
    prepare: Callable | None
    about: object
    src: object = None
    cast_any: Callable | None = None
    eager: Callable | None = None
    limit: float | None = None
    inplace_at: int = NEVER
    hidden: bool = True
    needs: Callable | None = None
    eager_prepare: Callable | None = None
    lowers: bool = True


def _body(spec):
    # ``spec``: a Spec as a plain tuple, the wrapper's one cell

    def wrapper(*args, **kwargs):
        st = tls
        # read once: another thread's revert() may retire this wrapper (swap its record) while a
        # call is inside it; the call then finishes under the record it started with
        s = spec
        if s[1] is PAUSED:
            return s[0](*args, **kwargs)
        if st.off:
            try:
                return s[0](*args, **kwargs)
            except Exception as e:  # costs nothing unless something raises
                rescue.uncast_error(e, s[2])
                raise
        op, rule, about, src, cast_any, eager, limit, inplace_at, hidden, needs, eager_prepare, lowers = s
        # once per call: compiled, traced or eager. Dynamo first: it folds is_dynamo_compiling() and reads
        # (guards on) nothing after it; eager is then two C calls (torch_private.after_dynamo otherwise)
        if _dynamo_compiling():
            running = _DYNAMO
        elif _compile_flag() or _tracing_state() is not None:
            running = _after_dynamo()
        else:
            running = 0
        if running == _LOWERING and lowers or needs is not None and not needs(args, kwargs):
            # a builtin's own ops are none of hmp's: autocast off for them (a Python function's calls
            # cast as usual, autocast following ``off``)
            return _as_torch(st, running, op, args, kwargs) if st.engine_on and not hidden else op(*args, **kwargs)
        if not running:  # eager: the rule on the casters' eager forms
            rule = eager_prepare
        # casts off from here: for the casts' own ops (a BF16 module's mode must not see them) and for
        # the ops this one calls (the outermost op decides: state.enter/leave, inlined, engine="autocast" too)
        st.off = OFF
        paused = st.engine_on and _pause(st, running)
        a = graph = None
        try:
            if src is None or kwargs or inplace_at != NEVER and len(args) > inplace_at and args[inplace_at]:
                a, k = rule(args, kwargs)
            elif src is _PROMOTE:
                a, k = (args, kwargs) if _one_dtype(args, None) is not False else rule(args, kwargs)
            else:
                a, k = _cast_each(args, src, cast_any if running else eager, limit), kwargs
                if a is _SAME:
                    a = args
                elif a is None:  # a number the lower dtype cannot hold: prepare runs the FP32 rule
                    a, k = rule(args, kwargs)
            # a Python function's body may hold operators, decided when the captured graph is lowered
            graph = hidden and running == _DYNAMO
            if graph:
                _graph_off(OFF)
            result = op(*a, **k)
            if st.fresh:  # also copies the op made in one dtype (sites.one_dtype_on_reject)
                hold(result, st.fresh)
            # a write into a copy reaches the caller's tensor (traced code: functionalized)
            if hidden and running < _COMPILING and (a is not args or k is not kwargs):
                _write_back(a, args, k, kwargs)
            return result
        except Exception as e:  # costs nothing unless something raises
            st.fresh.clear()
            if a is None:  # a cast raised: as without hmp's rescue
                raise
            result = rescue.rescue(e, op, about, args, kwargs, a, k)
            if result is rescue.RAISE:
                raise
            return result
        finally:
            st.off = 0
            if paused:
                _resume(st, paused)
            if graph:
                _graph_off(0)

    return wrapper


def made(spec):
    """A new wrapper doing what ``spec`` (a Spec) says."""
    return _body(tuple(spec))


_METADATA_KEY = "hmp_copies"


class _Held:
    """The weight copies one graph holds in its node's metadata, emptied at the next
    backward pass (cache.release)."""

    __slots__ = ("copies", "__weakref__")


def hold(result, fresh):
    """Give the graph of ``result`` the copies this call made (``fresh``, emptied): the
    cache holds them weakly and autograd saves only some (a weight, not a bias), so
    without this a bias would be cast at every call. A per-node backward hook would
    free them sooner but costs every node a Python call."""
    t = result if isinstance(result, torch.Tensor) else None
    if t is None and isinstance(result, (tuple, list)):
        t = next((r for r in result if isinstance(r, torch.Tensor)), None)
    node = getattr(t, "grad_fn", None)
    if node is not None:
        meta = node.metadata
        held = meta.get(_METADATA_KEY)
        copies_held = held.copies if held is not None else None  # read once: another thread's backward may release it
        if copies_held is None:
            held = meta[_METADATA_KEY] = _Held()
            copies_held = held.copies = []
            weight_cache.held.add(held)
        copies_held.extend(fresh)
    fresh.clear()


_BODY = _body(None).__code__


def _op_of(frame):
    """The op a wrapper frame calls: from the record the call read (``s``), or before its first line
    runs (a profiler's call event) from the wrapper's cell."""
    return (frame.f_locals.get("s") or frame.f_locals.get("spec") or (None,))[0]


wrapper_frames.register_wrapper(_BODY, _op_of)
