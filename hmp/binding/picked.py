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
integer the call names (at least ``_MIN_SIZE``); a trace beyond 64-bit sizes runs
as torch's."""

import functools

import torch

from hmp.binding import aten, spellings
from hmp.core.dtypes import FLOATS, first_floating

_TENSOR, _LIST, _TUPLE, _OTHER = "hmp:tensor", "hmp:list", "hmp:tuple", "hmp:other"
_LARGE = "hmp:large"  # a size of 2 or more: traced at the key's threshold
_PLAIN = (str, bool, int, float, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_EXACT = frozenset(_PLAIN)
# What stands for a symbolic number in the trace (a compiled graph's size passed on).
_SYMBOLIC = {"SymInt": 1, "SymFloat": 1.0, "SymBool": False}
# The least size a large dimension is traced at (2 or 3 may take a shortcut no larger size takes).
_MIN_SIZE = 4


def key(args, kwargs):
    """What of a call can pick its kernel: non-tensor arguments, each tensor's dtype and
    rank, each size as 0, 1 or ``_LARGE`` (dynamo specialises 0 and 1 itself). Tuples
    inside an argument's key are tagged, so no argument reads as a tag."""
    exact = _EXACT
    if all(type(v) in exact for v in args) and not kwargs:
        return tuple(args), None
    at = _threshold(args, kwargs)
    got = tuple([v if type(v) in exact else _key(v, at) for v in args])
    if not kwargs:
        return got, None
    return got, tuple([(n, v if type(v) in exact else _key(v, at)) for n, v in kwargs.items()])


def _threshold(args, kwargs):
    """One more than the largest integer the call names (at least ``_MIN_SIZE``): a size at or
    above it is larger than any pad, window or index the call names."""
    at = _MIN_SIZE
    for v in (*args, *(kwargs or {}).values()):
        at = _ints(v, at)
    return at


def _ints(v, at):
    """``at``, raised past every integer in ``v`` (plain loops: torch.compile traces this)."""
    t = type(v)
    if t is int:
        return max(at, abs(v) + 1)
    if t is tuple or t is list:
        for x in v:
            at = _ints(x, at)
    return at


def _key(v, at):
    t = type(v)
    if t in _EXACT:
        return v
    if t is tuple or t is list:
        items = tuple(v) if _EXACT.issuperset(map(type, v)) else tuple([_key(x, at) for x in v])
        return (_TUPLE if t is tuple else _LIST, items)
    if isinstance(v, torch.Tensor):
        return (_TENSOR, v.dtype, tuple([0 if n == 0 else 1 if n == 1 else _LARGE for n in v.shape]), at)
    if isinstance(v, _PLAIN):
        return v
    return (_OTHER, t.__name__)  # a SymInt, an object: what it is, not its value


def _value(k):
    """The trace's argument for ``_key``'s ``k``; LookupError for an object it cannot make."""
    if type(k) is not tuple:
        return k
    tag, what = k[0], k[1:]
    if tag == _TENSOR:
        dtype, sizes, at = what
        return torch.empty([at if n == _LARGE else n for n in sizes], dtype=dtype, device="meta")
    if tag == _OTHER:
        if what[0] not in _SYMBOLIC:
            raise LookupError(what[0])
        return _SYMBOLIC[what[0]]
    items = [_value(x) for x in what[0]]
    return items if tag == _LIST else tuple(items)


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
    constant. Each key is traced once and kept in a bounded cache while the wrapper lives."""
    rules = [_rule(kind, low) for _, kind, _ in computations]
    by_name = {}
    for i, (_, _, name) in enumerate(computations):
        by_name.setdefault(name, i)  # an operator a list names by its own name: where autocast casts

    @functools.lru_cache(maxsize=256)
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

    @torch.compiler.assume_constant_result
    def decide(k):
        return decided(k)

    def choose(args, kwargs):
        return decide(key(args, kwargs))

    return choose
