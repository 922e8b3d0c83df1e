"""Which list entry a callable is bound by, read from the names torch gives it.

The binding rule, as docs/lists.md states it: a list name ``X`` binds
``torch.X``, ``torch.nn.functional.X``, ``torch.Tensor.X``, the operators
``__X__``/``__rX__``/``__iX__``, the in-place forms ``X_``,
``torchvision.ops.X`` and the builtins generated from ``aten::X``; the fused
kernels of resolve.FUSED follow the list of the op they contain; an op in no
list that has no kernel for the lower dtype, or needs one dtype, gets the
FP32 or promote rule where a call needs it (lists.fallback_names); another
name of a listed op (hmp/binding/spellings.py: the same computation, read from
torch's registry) follows that op's entry. Here that
rule runs backwards, from a callable to the names that bind it, so the
testing kit's oracle does not ask hmp's resolver which site a call reaches.
"""

import functools
import inspect
import operator
import sys
import types
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from hmp.binding import aten, lists, pays, resolve, spellings
from hmp.binding.picked import flat
from hmp.binding.resolve import FUSED
from hmp.core import torch_private
from hmp.core.dtypes import FP32, LOW
from hmp.core.identity import unwrap
from hmp.core.switches import disable_casts

_HOMES = (("torch", torch), ("torch.nn.functional", F))
_SKIP = (type, types.ModuleType, staticmethod, classmethod, property)


class Call(NamedTuple):
    """A callable and its arguments, as the binding rule sees them."""

    fn: object  # what runs: torch's own function (a bound method's function, self first in ``args``)
    args: tuple
    names: frozenset  # every list name that binds it
    inplace: bool  # it writes its first argument (``X_``, ``__iX__``, or by its schema)
    written: tuple  # ((position, name), ...) of the other arguments its schema says it writes
    inplace_param: Optional[int]  # position of an ``inplace=`` parameter


class Bound(NamedTuple):
    kind: object  # its list's kinds.Kind, whose fields say the rule
    name: str  # the list name whose rule applies
    fallback: bool  # an op in no list, under its rule only where a call needs it
    whole_call: bool = False  # a decorated function (@hmp.bf16_function): its list's rule for every call


def _callable(value):
    return callable(value) and not isinstance(value, _SKIP)


# kept: a memo of what torch or a shipped file says, the same for every call, never written by one
@functools.lru_cache(maxsize=None)
def _table():
    """``{id(torch's own object): {attribute names}}`` over the places a list
    name binds; an hmp wrapper found there counts as what it wraps."""
    found = {}

    def add(value, attr):
        if _callable(value):
            found.setdefault(id(unwrap(value)), set()).add(attr)

    for _, module in _HOMES:
        for attr, value in list(vars(module).items()):
            add(value, attr)
    for klass in torch.Tensor.__mro__:
        for attr, value in list(vars(klass).items()):
            add(value, attr)
    for op, places in aten.aten_entry_points().items():
        for _, module, attr in places:
            add(getattr(module, attr, None), op)  # by its operator: torch.linalg.norm is linalg_norm, not norm
    return found


def _torchvision_attrs(fn):
    ops = sys.modules.get("torchvision.ops")
    if ops is None:
        return set()
    return {a for a, v in list(vars(ops).items()) if _callable(v) and unwrap(v) is fn}


def _names(attr):
    """``(names, inplace)`` of one attribute name: the list names that bind
    it, and whether it is an in-place form."""
    if attr.startswith("__") and attr.endswith("__"):
        x = attr[2:-2]
        names = {x} if not x.startswith("_") else set()
        inplace = False
        if x[:1] in ("r", "i") and hasattr(torch.Tensor, f"__{x[1:]}__"):  # __radd__, __iadd__
            names.add(x[1:])
            inplace = x[0] == "i"
        return names, inplace
    if attr.endswith("_"):
        return {attr, attr[:-1]}, True
    return {attr}, False


def _function_of(op, args):
    """``(torch's own function, its arguments)``: a bound method's function
    with its tensor first, an ``operator`` function as the Tensor operator
    it dispatches to (``operator.truediv(2, x)`` is ``x.__rtruediv__(2)``)."""
    owner = getattr(op, "__self__", None)
    if isinstance(owner, torch.Tensor):
        fn = getattr(op, "__func__", None)  # a bound Python function (an hmp wrapper on torch.Tensor)
        if fn is None:
            fn = inspect.getattr_static(type(owner), op.__name__, None)
        return unwrap(fn if fn is not None else op), (owner, *args)
    if getattr(op, "__module__", None) in ("operator", "_operator") and args:
        name = op.__name__
        if not isinstance(args[0], torch.Tensor) and len(args) == 2 and isinstance(args[1], torch.Tensor):
            reflected = inspect.getattr_static(torch.Tensor, f"__r{name}__", None)
            if reflected is not None:
                return unwrap(reflected), (args[1], args[0])
        dunder = inspect.getattr_static(torch.Tensor, f"__{name}__", None)
        if dunder is not None:
            return unwrap(dunder), tuple(args)
    return unwrap(op), tuple(args)


def _inplace_param(fn):
    if not isinstance(fn, types.FunctionType):
        return None
    positional = [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return positional.index("inplace") if "inplace" in positional else None


def call_of(op, args):
    """The Call of ``op(*args, ...)``."""
    fn, args = _function_of(op, args)
    own = getattr(fn, "__name__", None)
    attrs = set(_table().get(id(fn), ())) | _torchvision_attrs(fn)
    if attrs and isinstance(own, str) and aten.aten_op(own.rstrip("_")) is not None:
        attrs.add(own)  # a builtin generated from an aten operator carries that operator's name
    names, inplace = set(), False
    for attr in attrs:
        n, i = _names(attr)
        names |= n
        inplace = inplace or i
    written = ()
    if isinstance(own, str):
        written = resolve.writes(fn, own)  # torch's schemas: Tensor(a!)
        inplace = inplace or any(i == 0 for i, _ in written)
        written = tuple(w for w in written if w[0])
    return Call(fn, args, frozenset(names), inplace, written, None if inplace else _inplace_param(fn))


def bound_names(conversion):
    """``{kind: sorted names}`` (by kinds.Kind) of the entries a conversion binds: those
    that gain from their list's rule (pays.decision), in the kinds' order."""
    strict, one = conversion.options.strict, lists.one_dtype_names()
    return {k: sorted(n for n in v if pays.decision(k, n, strict, one)[0]) for k, v in conversion.lists.items()}


def binding(conversion, op, call, runtime):
    """The Bound of ``call`` (of ``op``) under ``conversion`` (``runtime``:
    hmp's state, for registrations and decorated functions), or None: left
    to torch."""
    decorated = runtime.decorated.get(op) if isinstance(op, types.FunctionType) else None
    if decorated is not None:
        return Bound(decorated, op.__qualname__, False, whole_call=True)
    for owner, attr, kind in runtime.registered:  # hmp's own records; this kit's Bound names the kind
        if unwrap(getattr(owner, attr, None)) is call.fn:
            return Bound(kind, attr, False)
    bound = bound_names(conversion)
    for kind, names in bound.items():  # listed names first, each kind's names in order
        for name in names:
            if name in call.names:
                return Bound(kind, name, False)
    for kind, names in bound.items():  # then the fused kernels of listed ops
        for name in names:
            for fused in FUSED.get(name, ()):
                if fused in call.names:
                    return Bound(kind, fused, False)
    listed_by_kind = tuple((k, tuple(v)) for k, v in bound.items())
    per_call = spellings.per_call(listed_by_kind, aten.python_builtins(), resolve.RNN_KERNELS)
    for kind, name, spelling in spellings.spellings(listed_by_kind, aten.python_builtins(), resolve.RNN_KERNELS):
        if spelling in call.names and spelling not in per_call:  # another name of a listed op (spellings.py)
            return Bound(kind, name, False)
    listed = set().union(*bound.values())
    for record, names in lists.fallback_names(conversion.options.low_precision_type):
        for name in names:  # a spelling decided per call is bound as one, not by its fallback rule
            if name not in listed and name in call.names and name not in per_call:
                return Bound(record, name, True)
    return None


def picked_binding(conversion, call, args, kwargs):
    """The Bound of a call of an op whose call picks its kernel (a string
    argument; hmp/binding/picked.py) or of a spelling decided per call
    (spellings.per_call), or None, found by running torch's own op on copies
    of these very arguments (not hmp's trace on meta tensors): a picked op
    whose only computing kernel is a listed op follows that op; else the call
    is run as torch.autocast runs it, each listed kernel it dispatches given
    its list's rule, and it follows the first listed kernel it reached whose
    rule, given to the call's own inputs, puts out what that run put out."""
    bound = bound_names(conversion)
    listed_by_kind = tuple((k, tuple(v)) for k, v in bound.items())
    fallback = frozenset(n for _, names in lists.fallback_names(conversion.options.low_precision_type) for n in names)
    builtins = aten.python_builtins()
    picked = set(spellings.picked(listed_by_kind, builtins, resolve.RNN_KERNELS, fallback))
    per_call = spellings.per_call(listed_by_kind, builtins, resolve.RNN_KERNELS)
    if not call.names & (picked | per_call):
        return None
    kind_of = {}
    for kind, names in bound.items():  # the first kind in binding order, as hmp binds
        for name in names:
            kind_of.setdefault(name, kind)
    fn, low = unwrap(call.fn), conversion.options.low_precision_type
    reached, listed, others = [], [], []
    with spellings.probing(), disable_casts():
        aten.dispatched(fn, lambda overload, a, k: reached.append(overload), *_copies(args), **kwargs)
    for o in reached:
        name = o.__name__.partition(".")[0]  # mm.default: the operator's name
        if name in kind_of:
            listed.append((kind_of[name], name))
        elif not _moves_values(o):
            others.append(name)
    if call.names & picked and len(listed) == 1 and not others:
        return Bound(listed[0][0], listed[0][1], False)
    if not listed:
        return None

    def as_autocast(overload, a, k):  # each listed kernel casts its own inputs, as autocast does at the dispatcher
        kind = kind_of.get(overload.__name__.partition(".")[0])
        return None if kind is None else _given(kind, low, a, k)

    with spellings.probing(), disable_casts():
        wanted = _first_floating(aten.dispatched(fn, as_autocast, *_copies(args), **kwargs))
        for kind, name in dict.fromkeys(listed):
            given_args, given_kwargs = _given(kind, low, _copies(args), kwargs)
            try:
                got = _first_floating(fn(*given_args, **given_kwargs))
            except Exception:
                continue
            if got == wanted:
                return Bound(kind, name, False)
    return None


def _copies(args):
    return [_copy_all(a) for a in args]


def _copy_all(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if type(v) is list or type(v) is tuple:
        return type(v)(_copy_all(x) for x in v)
    return v


def _first_floating(result):
    if isinstance(result, torch.Tensor):
        return result.dtype if result.is_floating_point() else None
    if type(result) is list or type(result) is tuple:
        return next((d for d in map(_first_floating, result) if d is not None), None)
    return None


def _given(kind, low, args, kwargs):
    """``(args, kwargs)`` as list ``kind``'s rule (its record's ``policy``) gives them, dtypes only:
    the lower rule takes float32 to ``low``, the FP32 rule the lower dtypes to float32, the promote
    rule every floating tensor to the widest (those with dimensions first); a ValueError for a rule
    this kit does not know."""
    tensors = [t for t in flat((*args, *kwargs.values())) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if kind.policy == "lower":
        to, src = low, (FP32,)
    elif kind.policy == "fp32":
        to, src = FP32, LOW
    elif kind.policy == "promote":
        ranked = [t.dtype for t in tensors if t.dim()] or [t.dtype for t in tensors]
        to = functools.reduce(torch.promote_types, ranked) if ranked else None
        src = tuple({t.dtype for t in tensors})
    else:
        raise ValueError(f"hmp.testing: no rule {kind.policy!r} in this kit (the {kind.name} list's)")

    def one(v):
        if isinstance(v, torch.Tensor):
            return v.to(to) if to is not None and v.dtype in src and v.dtype != to else v
        if type(v) is list or type(v) is tuple:
            return type(v)(one(x) for x in v)
        return v

    return tuple(one(a) for a in args), {n: one(v) for n, v in kwargs.items()}


def _moves_values(overload):
    """True for an op that computes nothing: its schema returns an alias of an input, or it allocates or copies."""
    schema = torch_private.overload_schema(overload)
    return any(r.alias_info is not None for r in schema.returns) or overload.__name__.split(".")[0] in (
        "empty",
        "empty_like",
        "new_empty",
        "empty_strided",
        "clone",
        "copy_",
        "_unsafe_view",
    )


def why_left(conversion, call):
    """Why a call no rule binds is torch's: its list's reason, or "in no list"."""
    strict, one = conversion.options.strict, lists.one_dtype_names()
    for kind, names in conversion.lists.items():
        for name in sorted(call.names & names):
            casts, why = pays.decision(kind, name, strict, one)
            if not casts:
                return f"{kind.title_in(conversion.options.low_precision_type)} list entry {name}: {why}"
    return "in no list"


def list_name(fn):
    """The list name a function torch saw is known by: ``matmul`` for
    ``__matmul__``, ``add`` for ``add_``; its own name where none applies."""
    own = getattr(fn, "__name__", "") or ""
    names, _ = _names(own)
    base = own[2:-2] if own.startswith("__") and own.endswith("__") else own
    for candidate in sorted(names, key=len):
        if candidate != base or len(names) == 1:
            return candidate
    return base


def public_function(name):
    """The public callable a user calls for list name ``name`` (its current
    attribute: hmp's wrapper while converted), or None: ``torch.nn.functional``
    first, then ``torch``, ``operator``, and for an aten name such as
    ``linalg_multi_dot`` or ``fft_rfft`` the submodule function."""
    for module in (F, torch, operator):
        value = getattr(module, name, None)
        if _callable(value):
            return value
    prefix, _, rest = name.partition("_")
    sub = getattr(torch, prefix, None) if rest else None
    value = getattr(sub, rest, None) if isinstance(sub, types.ModuleType) else None
    return value if _callable(value) else None
