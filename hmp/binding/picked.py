"""Ops whose kernel their call picks.

A composite operator (no kernel of its own: hmp/binding/spellings.py) that
takes a string reaches a different kernel for each value of it:
``F.pad(x, p, mode="reflect")`` runs reflection_pad2d, which the FP32 list
holds (CPU autocast computes it in float32), ``mode="constant"`` runs
constant_pad_nd, which no list holds. No probe at convert time knows the
strings a program will pass, so such an op, when no list names it, is bound
and decided per call: what the call dispatches, traced once on meta tensors
for each *key* of a call (its non-tensor arguments, its tensors' ranks and
dtypes: ``key``), is matched against the listed ops' computations as a
spelling's is. A match follows that entry's rule; any other call runs as
torch's, untouched, its inner ops cast as usual (wrap.make's ``needs``).

The decision is a function of the call's constants alone, so torch.compile
and torch.export take it while they trace (torch.compiler.assume_constant_result):
compiled and exported code cast what eager code casts.
"""

import functools

import torch

from hmp.binding import spellings

_TENSOR, _LIST, _TUPLE, _OTHER = "hmp:tensor", "hmp:list", "hmp:tuple", "hmp:other"
_PLAIN = (str, bool, int, float, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_EXACT = frozenset(_PLAIN)
# What stands for a symbolic number in the trace (a compiled graph's size passed on).
_SYMBOLIC = {"SymInt": 1, "SymFloat": 1.0, "SymBool": False}
# The trace's tensors are one size in every dimension, larger than every integer the call names (a pad
# must be smaller than the dimension it pads; stft's window fits its input): no list of shapes can
# know a call's sizes. Capped so that a 6-d tensor's element count still fits in 64 bits.
_MIN_SIZE, _MAX_SIZE = 4, 1024


def key(args, kwargs):
    """What of a call can pick its kernel: every non-tensor argument, each
    tensor's rank and dtype (not its sizes: a compiled graph's may be
    symbolic). ``(args' keys, ((keyword, key), ...) or None)``; every tuple
    inside an argument's key is tagged, so no argument reads as a tag."""
    exact = _EXACT
    got = tuple([v if type(v) in exact else _key(v) for v in args])
    if not kwargs:
        return got, None
    return got, tuple([(n, v if type(v) in exact else _key(v)) for n, v in kwargs.items()])


def _key(v):
    t = type(v)
    if t in _EXACT:
        return v
    if t is tuple or t is list:
        items = tuple(v) if _EXACT.issuperset(map(type, v)) else tuple([_key(x) for x in v])
        return (_TUPLE if t is tuple else _LIST, items)
    if isinstance(v, torch.Tensor):
        return (_TENSOR, v.dim(), v.dtype)
    if isinstance(v, _PLAIN):
        return v
    return (_OTHER, t.__name__)  # a SymInt, an object: what it is, not its value


def _value(k, size):
    """The trace's argument for ``_key``'s ``k``; LookupError for an object it cannot make."""
    if type(k) is not tuple:
        return k
    tag, what = k[0], k[1:]
    if tag == _TENSOR:
        return torch.empty((size,) * what[0], dtype=what[1], device="meta")
    if tag == _OTHER:
        if what[0] not in _SYMBOLIC:
            raise LookupError(what[0])
        return _SYMBOLIC[what[0]]
    items = [_value(x, size) for x in what[0]]
    return items if tag == _LIST else tuple(items)


def _ints(k):
    if type(k) is int:
        yield abs(k)
    elif type(k) is tuple and k[0] in (_LIST, _TUPLE):
        for x in k[1]:
            yield from _ints(x)


def _size(k):
    given, keywords = k
    values = (*given, *(v for _, v in keywords or ()))
    largest = max((i for v in values for i in _ints(v)), default=0)
    return min(max(_MIN_SIZE, 2 * largest + 2), _MAX_SIZE)


def chooser(fn, computations):
    """``choose(args, kwargs)``: the position in ``computations``
    (spellings.computations' answer) of the entry whose rule a call of ``fn``
    follows, or None: a plain int, a constant torch.compile and torch.export
    carry into the graph (a kinds.Kind record is no constant to them). Each
    key of a call is traced once (kept while the wrapper lives: what a call
    of torch's composite dispatches never changes within a process)."""

    @functools.lru_cache(maxsize=256)
    def decided(k):
        size = _size(k)
        try:
            args = [_value(v, size) for v in k[0]]
            kwargs = {n: _value(v, size) for n, v in k[1] or ()}
        except LookupError:  # an argument the trace cannot stand in for: torch's call, as without hmp
            return None
        with spellings.probing():
            ops = spellings.traced(fn, args, kwargs)
        if not ops:  # did not run, or computes nothing (a view)
            return None
        return next((i for i, (computed, _, _) in enumerate(computations) if ops in computed), None)

    @torch.compiler.assume_constant_result
    def decide(k):
        return decided(k)

    def choose(args, kwargs):
        return decide(key(args, kwargs))

    return choose
