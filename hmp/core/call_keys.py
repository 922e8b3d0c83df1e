"""Per call: the key of a call whose kernel its arguments pick, and the decision looked up by
it (the decision itself, a trace on meta tensors once per key, is hmp/binding/picked.py's).

A key holds what of a call can pick its kernel: non-tensor arguments, each tensor's dtype
and rank, each size as 0, 1 or large (dynamo specialises 0 and 1 itself). A large size is
traced at one more than the largest integer the call names (at least ``MIN_SIZE``)."""

import functools

import torch

TENSOR, LIST, TUPLE, OTHER = "hmp:tensor", "hmp:list", "hmp:tuple", "hmp:other"
LARGE = "hmp:large"  # a size of 2 or more: traced at the key's threshold
_PLAIN = (str, bool, int, float, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_EXACT = frozenset(_PLAIN)
# The least size a large dimension is traced at (2 or 3 may take a shortcut no larger size takes).
MIN_SIZE = 4


def key(args, kwargs):
    """What of a call can pick its kernel. Tuples inside an argument's key are tagged, so no
    argument reads as a tag."""
    exact = _EXACT
    if all(type(v) in exact for v in args) and not kwargs:
        return tuple(args), None
    at = _threshold(args, kwargs)
    got = tuple([v if type(v) in exact else _key(v, at) for v in args])
    if not kwargs:
        return got, None
    return got, tuple([(n, v if type(v) in exact else _key(v, at)) for n, v in kwargs.items()])


def _threshold(args, kwargs):
    """One more than the largest integer the call names (at least ``MIN_SIZE``): a size at or
    above it is larger than any pad, window or index the call names."""
    at = MIN_SIZE
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
        return (TUPLE if t is tuple else LIST, items)
    if isinstance(v, torch.Tensor):
        return (TENSOR, v.dtype, tuple([0 if n == 0 else 1 if n == 1 else LARGE for n in v.shape]), at)
    if isinstance(v, _PLAIN):
        return v
    return (OTHER, t.__name__)  # a SymInt, an object: what it is, not its value


def looked_up(decided):
    """``choose(args, kwargs)``: ``decided(key)`` for the call's key, each key decided once and kept
    in a bounded cache while the wrapper lives; a plain int or None, which torch.compile and export
    carry as a constant (the decision depends on the call's constants alone)."""
    cached = functools.lru_cache(maxsize=256)(decided)

    @torch.compiler.assume_constant_result
    def decide(k):
        return cached(k)

    def choose(args, kwargs):
        return decide(key(args, kwargs))

    return choose
