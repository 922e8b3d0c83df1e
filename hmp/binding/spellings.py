"""The other names of a listed op, found from torch's operator registry.

torch.autocast casts at the dispatcher, where every spelling of an op arrives as one
operator; hmp binds Python names. So a list name also binds every *spelling* of its
op: builtins of a composite aten operator whose computation is the listed op's
(``torch.linalg.matmul``, ``torch.inner`` -> ``mm``; ``torch.einsum`` -> ``bmm``;
``torch.true_divide`` -> ``div``).

An op's computation is what it dispatches when traced on meta tensors, views, copies
and allocations left out; it is a spelling when everything it computes, over every
probe shape with optional tensors left out and given, is something the listed op
computes. Recurrent kernels are never probed (one crashes the process on meta). The
probe restores the random state, silences warnings and keeps no grad. An op listed
under its own name follows its own entry; a match in two lists follows the first in
binding order. Built once per process per set of listed names."""

import contextlib
import functools
import types
import warnings

import torch

from hmp.binding import aten
from hmp.binding.aten import aten_op, makes_view
from hmp.core import torch_private

# Probe shapes, tried in order until the call runs: every tensor argument gets the same one.
SHAPES = ((4, 4), (2, 4, 4), (2, 4, 4, 4), (4,))
# The one argument no schema type can fill: einsum's equation. A last resort by argument
# name, for the probe only (what binds is still the traced computation).
_STRINGS = {"equation": {2: "ij,jk->ik"}}
_ALLOCATES = frozenset(("empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided"))
_SCALARS = {"int": 1, "SymInt": 1, "float": 0.5, "bool": False, "Scalar": 2, "number": 2}
# _unsafe_view's schema returns a new tensor, but it only reinterprets one its caller just made;
# clone and copy_ move values (a reshape of a permuted tensor copies it) and compute none.
_NO_COMPUTE = _ALLOCATES | {"_unsafe_view", "clone", "copy_"}


def _argument(arg, shape, sizes=1):
    """A probe value for one schema argument (``sizes``: the length of an int list whose
    schema gives none), or raise LookupError."""
    jit_type = str(arg.type)  # the schema's JIT type: Tensor, List[Tensor], List[int], Optional[...], int, ...
    if jit_type == "Tensor":
        return torch.empty(shape, device="meta")
    if jit_type == "List[Tensor]":
        return [torch.empty(shape, device="meta"), torch.empty(shape, device="meta")]
    if jit_type in _SCALARS:
        return _SCALARS[jit_type]
    if jit_type == "List[int]":  # sizes, strides, dims: 2, not 1, where 1 takes a shortcut (a pool to 1 is a mean)
        return [2] * (getattr(arg, "N", None) or sizes)
    if jit_type.startswith("Optional["):
        return None
    if jit_type == "str" and len(shape) in _STRINGS.get(arg.name, {}):
        return _STRINGS[arg.name][len(shape)]
    raise LookupError(jit_type)


def _needs_out(schema):
    return any(a.kwarg_only and not a.has_default_value() for a in schema.arguments)


def probe_args(schema, shape, optional_tensors=False, sizes=1):
    """Positional arguments for ``schema`` (defaults where it has them; with
    ``optional_tensors``, a tensor for each optional one; ``sizes``: as ``_argument``'s), or None."""
    args = []
    for arg in schema.arguments:
        if arg.kwarg_only:
            if not arg.has_default_value():
                return None  # an out= overload
            continue
        try:
            if optional_tensors and str(arg.type) == "Optional[Tensor]":
                args.append(torch.empty(shape, device="meta"))
            else:
                args.append(arg.default_value if arg.has_default_value() else _argument(arg, shape, sizes))
        except LookupError:
            return None
    return args


def traced(fn, args, kwargs=None):
    """The computing ops ``fn(*args, **kwargs)`` dispatches, in order, or None where it does not run."""
    ops = []

    def seen(overload, a, k):
        name = overload.__name__.partition(".")[0]  # mm.default: the operator's name
        if name not in _NO_COMPUTE and not makes_view(overload):
            ops.append(name)

    try:
        aten.dispatched(fn, seen, *args, **(kwargs or {}))
    except Exception:
        return None
    return tuple(ops)


@contextlib.contextmanager
def probing():
    """A deprecated op warns when it runs, a random one draws: a probe is not the user's call."""
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]), torch.no_grad():
        warnings.simplefilter("ignore")
        yield


def _single_tensor(schema):
    return len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor"


# kept: a memo of what torch or a shipped file says, the same for every call, never written by one
@functools.lru_cache(maxsize=None)
def computation(name, builtin=None):
    """What ``aten::name`` computes: the set of op sequences it dispatches
    over the probe shapes that run, each with its optional tensors left out
    and given, called through ``builtin`` (its Python builtin, so a warning it
    gives is Python's to silence) or its operator; None when no probe runs."""
    packet = aten_op(name)
    if packet is None:
        return None
    with probing():
        return _computation(packet, builtin)


# kept: a memo of what torch or a shipped file says, the same for every call, never written by one
@functools.lru_cache(maxsize=None)
def _first(name, builtin):
    """One thing ``aten::name`` computes (its first probe that runs), or None: most composite
    ops are told apart from every listed one by it, before the full computation is traced."""
    with probing():
        return next((ops for _, ops in _probes(aten_op(name), builtin) if ops is not None), None)


def _computation(packet, builtin):
    """Every probe's ops, of the first overload where one runs."""
    found = set()
    for _, ops in _probes(packet, builtin):
        if ops is not None:
            found.add(ops)
        elif found:  # the end of the first overload where a probe ran
            break
    return frozenset(found) if found else None


def _probes(packet, builtin):
    """``(overload, ops)`` of each probe that runs, and ``(overload, None)`` where an overload's
    probes end: the single-tensor overloads in order, each over the probe shapes, with its
    optional tensors left out and then given."""
    for overload in packet.overloads():
        schema = torch_private.schema_of(packet, overload)
        if not _single_tensor(schema):
            continue
        fn = builtin if builtin is not None else getattr(packet, overload)
        optional = any(str(a.type) == "Optional[Tensor]" for a in schema.arguments)
        for shape in SHAPES:
            for given in (False, True) if optional else (False,):
                args = probe_args(schema, shape, given)
                ops = None if args is None else traced(fn, args)
                if ops is not None:
                    yield overload, ops
        yield overload, None


# kept: a memo of what torch or a shipped file says, the same for every call, never written by one
@functools.lru_cache(maxsize=None)
def composite(name):
    """True when every overload of ``aten::name`` a call can reach (``out=``
    aside) only calls other ops."""
    packet = aten_op(name)
    if packet is None:
        return False
    reached = []
    for o in packet.overloads():
        try:
            if not _needs_out(torch_private.schema_of(packet, o)):
                reached.append(torch_private.composite_implicit(getattr(packet, o)))
        except Exception:  # an overload the registry names but cannot look up (einsum.sublist)
            continue
    return bool(reached) and all(reached)


# kept: a memo of what torch or a shipped file says, the same for every call, never written by one
@functools.lru_cache(maxsize=8)
def computations(listed, builtins, unprobed=frozenset()):
    """``((computation, kind, listed name), ...)`` in binding order: what
    each listed op computes (an op with kernels of its own: itself). The
    arguments are ``spellings``'."""
    out = []
    through = dict(builtins)
    for kind, names in listed:
        for name in names:
            if name in unprobed or aten_op(name) is None:
                continue
            # an operator with kernels of its own dispatches as itself: nothing to run
            ops = computation(name, through.get(name)) if composite(name) else frozenset({(name,)})
            if ops:
                out.append((ops, kind, name))
    return tuple(out)


# kept: a memo of what torch or a shipped file says, the same for every call, never written by one
@functools.lru_cache(maxsize=8)
def spellings(listed, builtins, unprobed=frozenset()):
    """``((kind, listed name, spelling), ...)``: the composite operators among ``builtins``
    whose computation is a listed op's. ``listed``: ``((kind, (names, ...)), ...)`` in
    binding order. ``unprobed``: ops never run with made-up arguments (the recurrent kernels)."""
    theirs = computations(listed, builtins, unprobed)
    if not theirs:
        return ()
    taken = {n for _, names in listed for n in names}
    out = []
    computed = set().union(*(ops for ops, _, _ in theirs))
    for name, builtin in builtins:
        if name in taken or name in unprobed or not isinstance(builtin, types.BuiltinFunctionType):
            continue
        if not composite(name) or _first(name, builtin) not in computed:
            continue
        found = computation(name, builtin)
        if not found or () in found:  # runs nowhere, or only makes a view somewhere
            continue
        # every computation of the spelling is one of the entry's: matmul (mm, bmm, dot) is no spelling
        # of mm, linear (addmm with a bias) none of matmul; torch.linalg.matmul is matmul's
        matches = [(kind, entry) for ops, kind, entry in theirs if found <= ops]
        if matches:
            # named after the entry with its very schema (linalg_matmul: matmul), else the kernel's own (einsum: bmm)
            same = [m for m in matches if _signatures(m[1]) & _signatures(name)]
            kernel = [m for m in matches if not composite(m[1])]
            out.append((*(same or kernel or matches)[0], name))
    return tuple(out)


def per_call(listed, builtins, unprobed=frozenset()):
    """The spellings decided call by call (picked.py): those with a decomposition of their
    own that a call's arguments steer (``einsum``'s equation, ``tensordot``'s dims,
    ``inner``'s ranks). A spelling that takes its entry's arguments and computes exactly
    what the entry does (``torch.linalg.matmul``) always follows the entry."""
    theirs = {name: ops for ops, _, name in computations(listed, builtins, unprobed)}
    through = dict(builtins)
    return frozenset(
        s
        for _, entry, s in spellings(listed, builtins, unprobed)
        if not (_signatures(entry) & _signatures(s) and computation(s, through.get(s)) == theirs.get(entry))
    )


def kernels(computations):
    """The entries of ``computations`` (its answer) that are operators with kernels of their own,
    what a per-call spelling's trace can reach by name (it never dispatches a composite entry)."""
    return tuple(c for c in computations if c[0] == frozenset({(c[2],)}))


# kept: what torch's registry says an op computes, traced once on meta tensors, never written by a call
@functools.lru_cache(maxsize=8)
def picked(listed, builtins, unprobed=frozenset(), skip=frozenset()):
    """The composite operators among ``builtins`` that take a string (the
    kernel they reach is the call's: hmp/binding/picked.py), no list names, are
    no spelling and not in ``skip`` (ops with a rule of their own); none
    where nothing is listed. Arguments as ``spellings``'."""
    if not computations(listed, builtins, unprobed):
        return ()
    taken = {n for _, names in listed for n in names} | {s for *_, s in spellings(listed, builtins, unprobed)}
    names = dict.fromkeys(name for name, _ in builtins)  # a name's builtins in several namespaces: once
    return tuple(
        n for n in names if n not in taken and n not in unprobed and n not in skip and _takes_string(n) and composite(n)
    )


def _takes_string(name):
    """True when an overload of ``aten::name`` takes a string that may pick a kernel. Not a
    named-tensor overload, whose ``Dimname`` older releases print as ``str``: one that takes a
    list of names, a dimension another overload takes as an int (argsort.dimname's ``dim``), or
    a string a named-tensor overload takes (flatten.named_out_dim's ``out_dim``)."""
    packet = aten_op(name)
    schemas = []
    for o in packet.overloads() if packet is not None else ():
        try:
            schemas.append([(a.name, str(a.type)) for a in torch_private.schema_of(packet, o).arguments])
        except Exception:  # an overload the registry names but cannot look up (einsum.sublist)
            continue
    names = {n for arguments in schemas for n, t in arguments if t in ("int", "SymInt")}
    named = []
    while True:  # a string that names a dimension in one overload names one in every overload
        named = [a for a in schemas if any(t == "List[str]" or t == "str" and n in names for n, t in a)]
        more = names | {n for a in named for n, t in a if t == "str"}
        if more == names:
            break
        names = more
    return any(t == "str" for arguments in schemas if arguments not in named for _, t in arguments)


# kept: a memo of what torch or a shipped file says, the same for every call, never written by one
@functools.lru_cache(maxsize=None)
def _signatures(name):
    packet = aten_op(name)
    found = set()
    for o in packet.overloads() if packet is not None else ():
        try:
            found.add(tuple((a.name, str(a.type)) for a in torch_private.schema_of(packet, o).arguments))
        except Exception:
            continue
    return found
