"""Which entries of the lower-precision list gain from it: bf16 where it pays.

A matrix product, convolution or RNN does many multiply-adds per element read, so
the lower dtype pays and its inputs are cast down. A one-pass op gains nothing (the
cast is a pass of its own) and may round the program's state: pointwise ops (an EMA),
random ops (dropout), normalisations (bf16's step at 1000 is 8). Outside strict mode
such an entry is treated as unlisted: torch decides its dtype from its inputs
(docs/never-changes.md). ``strict=True`` casts every entry.

Pointwise and random ops come from torch's op tags; normalisations have no tag and
are named (``NORMALIZATIONS``, checked against torch.nn by tests/unit/binding/test_where_it_pays.py)."""

import functools
import operator
import warnings

import torch
import torch.nn.functional as F

from hmp.binding import aten
from hmp.binding.aten import aten_op, returns_view
from hmp.binding.resolve import FUSED, RNN_KERNELS
from hmp.core import state

POINTWISE, RANDOM, NORMALIZATION = "pointwise", "random", "normalization"

# why an entry of the lower list does not cast outside strict mode, for messages
WHY = {
    POINTWISE: "pointwise (torch's pointwise tag): torch's type promotion decides its dtype",
    RANDOM: "random, like dropout (torch's nondeterministic_seeded tag): it runs in its input's dtype",
    NORMALIZATION: "a normalisation: it runs in its input's dtype, and a float32 input is never rounded",
}

NORMALIZATIONS = frozenset(
    (
        "batch_norm",
        "layer_norm",
        "group_norm",
        "instance_norm",
        "rms_norm",
        "native_batch_norm",
        "native_layer_norm",
        "native_group_norm",
    )
)

_POINTWISE, _SEEDED = torch.Tag.pointwise, torch.Tag.nondeterministic_seeded
_HOLD_PRODUCTS = RNN_KERNELS.union(*FUSED.values())  # kernels with matrix products inside


def why_not(name):
    """None for a lower-list entry that casts (it gains from the lower
    dtype); else the reason it is left to torch outside strict mode
    (POINTWISE, RANDOM or NORMALIZATION)."""
    if name in NORMALIZATIONS:
        return NORMALIZATION
    if is_random(name):
        return RANDOM
    if is_pointwise(name):
        return POINTWISE
    return None


def _tagged(packet, tag):
    return packet is not None and any(tag in getattr(packet, o).tags for o in packet.overloads())


def _callables(name):
    """What a call of list name ``name`` may reach first: a torch.nn.functional
    or torch function (``dropout1d``, whose arguments have defaults), its aten
    operator, a Python operator (``truediv``)."""
    found = (getattr(F, name, None), getattr(torch, name, None), aten_op(name), getattr(operator, name, None))
    return [fn for fn in found if callable(fn)]


def _ops_of(fn, *args):
    """The aten overloads ``fn(*args)`` dispatches, in order."""
    ops = []
    aten.dispatched(fn, lambda op, a, k: ops.append(op), *args)
    return ops


def _reached(fn):
    """The aten overloads a call of ``fn`` on float tensors reaches (one or two
    arguments, as it accepts), with the random stream as it was; None when
    it takes no such call."""
    for arity in (1, 2):
        for shape in ((2, 2, 2, 2), (2, 2, 2)):  # dropout1d takes 3 dimensions at most
            args = [torch.ones(shape) for _ in range(arity)]
            try:
                with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return _ops_of(fn, *args)
            except Exception:  # not callable with float tensors alone
                continue
    return None


# kept: a memo of what torch or a shipped file says, the same for every call, never written by one
@functools.lru_cache(maxsize=None)
def is_random(name):
    """True when list name ``name`` binds a random op: an overload carries torch's
    ``nondeterministic_seeded`` tag, or a call on float tensors reaches one. A kernel
    that contains a matrix product carries the tag for its optional dropout and is not."""
    if name.startswith("_") or name in _HOLD_PRODUCTS:
        return False
    packet = aten_op(name)
    if packet is not None:
        return _tagged(packet, _SEEDED)
    for fn in _callables(name):
        reached = _reached(fn)
        if reached is not None:
            return any(_SEEDED in op.tags for op in reached)
    return False


# kept: a memo of what torch or a shipped file says, the same for every call, never written by one
@functools.lru_cache(maxsize=None)
def is_pointwise(name):
    """True when list name ``name`` binds a pointwise op: an overload of
    ``aten::name`` carries torch's ``pointwise`` tag, or (an alias such as
    ``multiply``, a Python operator name such as ``truediv`` or Habana's
    ``iadd``) a call of it on float tensors reaches only tagged overloads."""
    packet = aten_op(name)
    if _tagged(packet, _POINTWISE):
        return True
    fn = packet if packet is not None else getattr(operator, name, None)
    if fn is None or name.startswith("_") or _tagged(packet, _SEEDED):
        return False
    reached = _reached(fn)
    return bool(reached) and all(_POINTWISE in op.tags for op in reached)


CAST = "cast"


def decision(kind, name, strict, one_dtype):
    """What list ``kind``'s (a kinds.Kind) entry ``name`` does: ``(casts,
    why)``. ``casts``: it gets a wrapper that applies its list's rule;
    ``why``: one line for effective_lists(detail=True) and the verbose log.
    ``one_dtype``: the ops whose kernels need one dtype (lists.one_dtype_names)."""
    if returns_view(name):
        return False, "never cast: it returns a view of its input, and a cast copy would not be one"
    if strict:
        return True, CAST
    why = kind.unbound(name, one_dtype) if kind.unbound is not None else None
    return (True, CAST) if why is None else (False, why)


def unless_it_pays(name, one_dtype):
    """Why a lower-list entry is not bound outside strict mode, or None: it gains nothing from the lower dtype."""
    why = why_not(name)
    return None if why is None else f"not cast outside strict mode: {WHY[why]}"


def unless_one_dtype(name, one_dtype):
    """Why a promote-list entry is not bound, or None: torch's type promotion already serves it."""
    return None if name in one_dtype else "not wrapped: torch's type promotion already gives its inputs one dtype"


SHORT = {POINTWISE: "pointwise", RANDOM: "random", NORMALIZATION: "normalisations"}  # WHY in a word


def warn_left_to_torch(names, where):
    """One short warning per file for a user's lower-precision list (``where``: its title and path)
    naming entries that cast only under strict=True, each group with why in a word, so no line of the
    file seems to do what it does not; effective_lists(detail=True) says why each at length."""
    left = {n: why_not(n) for n in sorted(names)}
    left = {n: why for n, why in left.items() if why is not None}
    if not left or not state.first_time(("left to torch", where)):
        return
    by_reason = {}
    for name, why in left.items():
        by_reason.setdefault(why, []).append(name)
    said = "; ".join(f"{', '.join(names)} ({SHORT[why]})" for why, names in by_reason.items())
    warnings.warn(
        f"hmp: {where}: not cast outside strict mode, left to torch (they gain nothing from the lower dtype): "
        f"{said}. hmp.effective_lists(detail=True) says why; strict=True casts them.",
        UserWarning,
        stacklevel=state.user_stacklevel(),
    )
