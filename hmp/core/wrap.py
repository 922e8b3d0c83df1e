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


def _body(op, prepare, about, src, cast, limit, inplace_at, hidden, needs, eager_prepare):
    # While torch.compile lowers a captured graph, torch's own code calls this op by name: it runs
    # as torch's (torch_private.after_dynamo: LOWERING). Not an operator (``a @ b``): dynamo records those as
    # Python's operator, never as this wrapper, so the graph reaches it only while lowering.
    lowers = not (getattr(op, "__name__", "").startswith("__") and getattr(op, "__name__", "").endswith("__"))
    # the lean path's cast (a cast_copies.Cast): in eager code its eager form, which asks nothing per tensor
    cast_any, eager = (None, None) if cast is None else cast
    inplace = inplace_at != NEVER  # the op has an ``inplace`` parameter

    def wrapper(*args, **kwargs):
        st = tls
        # read once: another thread's revert() may retire this wrapper (its prepare set to PAUSED)
        # while a call is inside it; the call then finishes under the configuration it started in
        rule = prepare
        if rule is PAUSED:
            return op(*args, **kwargs)
        if st.off:
            try:
                return op(*args, **kwargs)
            except Exception as e:  # costs nothing unless something raises
                rescue.uncast_error(e, about)
                raise
        # once per call: compiled, traced or eager. Dynamo first: it folds is_dynamo_compiling() and
        # reads nothing after it; eager is then two C calls (torch_private.after_dynamo otherwise)
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
            if src is None or kwargs or inplace and len(args) > inplace_at and args[inplace_at]:
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


_BODY = _body(None, None, None, None, None, None, None, None, None, None).__code__
wrapper_frames.register_wrapper(_BODY)  # the op a frame calls: its local ``op``
