"""Ops whose kernel their call picks.

A composite op that takes a string reaches a different kernel per value
(``F.pad(..., mode="reflect")`` runs reflection_pad2d, on the FP32 list;
``mode="constant"`` runs constant_pad_nd, on none), and a spelling with its own
decomposition is steered by its arguments (``einsum("ij,jk->ik")`` runs bmm). No
convert-time probe knows those arguments, so such an op is decided per call, as
torch.autocast decides at each kernel: the call's dispatch, traced once on meta
tensors per ``key`` (non-tensor arguments, ranks, dtypes, each size as 0, 1 or
more), decides it (``chooser``):

- the trace is rerun with every listed kernel cast by its list's rule: its result's
  dtype is what the call puts out;
- a call whose whole trace is a listed op's computation follows that entry; else the
  first entry the trace reaches whose rule gives that dtype.

Any other call runs as torch's, its inner ops cast as usual. The decision depends on
the call's constants alone, so torch.compile and export take it while tracing
(``assume_constant_result``). A large size is traced at one more than the largest
integer the call names (core/call_keys.py); a trace beyond 64-bit sizes runs
as torch's."""

import functools

import torch

from hmp.binding import aten, spellings
from hmp.core import call_keys
from hmp.core.dtypes import FLOATS, first_floating

# What stands for a symbolic number in the trace (a compiled graph's size passed on).
_SYMBOLIC = {"SymInt": 1, "SymFloat": 1.0, "SymBool": False}


def _value(k):
    """The trace's argument for a part ``k`` of a call's key (core/call_keys.py); LookupError for an
    object it cannot make."""
    if type(k) is not tuple:
        return k
    tag, what = k[0], k[1:]
    if tag == call_keys.TENSOR:
        dtype, sizes, at = what
        return torch.empty([at if n == call_keys.LARGE else n for n in sizes], dtype=dtype, device="meta")
    if tag == call_keys.OTHER:
        if what[0] not in _SYMBOLIC:
            raise LookupError(what[0])
        return _SYMBOLIC[what[0]]
    items = [_value(x) for x in what[0]]
    return items if tag == call_keys.LIST else tuple(items)


def flat(values):
    """The values in ``values`` at any depth of list and tuple (a call's arguments: ``torch.cat([a, b])``)."""
    for v in values:
        if type(v) is list or type(v) is tuple:
            yield from flat(v)
        else:
            yield v


def _map(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if type(value) is list or type(value) is tuple:
        return type(value)([_map(v, fn) for v in value])
    return value


def _rule(kind, low):
    """What list ``kind``'s rule does to a call's floating tensors, as dtypes (its lean record:
    hmp/binding/kinds.py): ``(args, kwargs) -> (args, kwargs)``, on the trace's meta tensors."""
    lean = kind.lean

    def cast(args, kwargs):
        floating = [t for t in flat((*args, *kwargs.values())) if isinstance(t, torch.Tensor) and t.dtype in FLOATS]
        if lean.one_dtype:  # promote: all to the widest, tensors with dimensions first (torch's ranking)
            ranked = [t.dtype for t in floating if t.dim()] or [t.dtype for t in floating]
            to = functools.reduce(torch.promote_types, ranked) if ranked else None
            src = FLOATS
        else:
            to, src = low if lean.to is None else lean.to, lean.src

        def one(t):
            return t.to(to) if to is not None and t.dtype in src and t.dtype != to else t

        return _map(tuple(args), one), {n: _map(v, one) for n, v in kwargs.items()}

    return cast


def _simulated(fn, args, kwargs, by_name, rules):
    """``(result, reached)``: ``fn`` run with every kernel a list names cast by its list's rule, as
    autocast casts at the dispatcher; ``reached``: those entries' positions, in the order reached."""
    reached = []

    def cast(overload, a, k):
        i = by_name.get(overload.__name__.partition(".")[0])
        if i is None:
            return None
        reached.append(i)
        return rules[i](a, k)

    try:
        return aten.dispatched(fn, cast, *args, **kwargs), reached
    except Exception:
        return None, reached


def chooser(fn, computations, low):
    """``choose(args, kwargs)``: the position in ``computations`` of the entry a call of
    ``fn`` follows, or None; a plain int, which torch.compile and export carry as a
    constant (core/call_keys.py looks it up per call; each key is traced once here)."""
    rules = [_rule(kind, low) for _, kind, _ in computations]
    by_name = {}
    for i, (_, _, name) in enumerate(computations):
        by_name.setdefault(name, i)  # an operator a list names by its own name: where autocast casts

    def decided(k):
        try:
            args = [_value(v) for v in k[0]]
            kwargs = {n: _value(v) for n, v in k[1] or ()}
        except LookupError:  # an argument the trace cannot stand in for: torch's call, as without hmp
            return None
        with spellings.probing():
            ops = spellings.traced(fn, args, kwargs)
            if not ops:  # did not run, or computes nothing (a view, a copy)
                return None
            whole = next((i for i, (computed, _, _) in enumerate(computations) if ops in computed), None)
            if whole is not None:  # the call is a listed computation, all of it
                return whole
            result, reached = _simulated(fn, args, kwargs, by_name, rules)
            wanted = first_floating(result)
            for i in dict.fromkeys(reached):
                cast_args, cast_kwargs = rules[i](args, kwargs)
                try:
                    got = first_floating(fn(*cast_args, **cast_kwargs))
                except Exception:
                    continue
                if got == wanted:
                    return i
        return None

    return call_keys.looked_up(decided)
