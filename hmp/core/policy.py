"""Cast policies: which arguments of a call are cast, and to which dtype.

Each policy is a factory returning ``prepare(args, kwargs) -> (args, kwargs)``, which
returns its inputs themselves when nothing needs a cast and never mutates them.
``casters`` maps a dtype to a cast_copies.Cast, chosen at convert time (plain or
through the weight cache); which prepare a site calls is decided in
hmp/binding/sites.py. ``needs`` says when an op in no list must step in."""

import logging

import torch

from hmp.core import dtypes, torch_private
from hmp.core.cast_copies import is_number, overflow_limit
from hmp.core.dtypes import FLOATS, FP32, FP32_ONLY, HALVES, OTHER_FLOATS

log = logging.getLogger("hmp")

Tensor = torch.Tensor
_promote_types = torch.promote_types  # captured: listing promote_types cannot recurse
_INF = float("inf")
_dynamo_compiling = torch_private.dynamo_compiling

SAME = object()  # cast_each: nothing was cast
PROMOTE = object()  # a lean wrapper's src for the promote rule's common case (one floating dtype: as given)


def cast_each(seq, src, cast, limit=None):
    """``seq`` with every tensor whose dtype is in ``src`` passed through ``cast``, at any
    depth of lists and tuples, or ``SAME`` when nothing was cast (a sentinel: dynamo
    cannot compare tuples by identity without a graph break). A tensor subclass whose
    cast raises stays uncast. ``limit``: a bound on the numbers in ``seq``; when a finite
    one lies beyond it the result is None (the BF16 rule's overflow check). The lean path's hot loop:
    common types are tested first, by identity."""
    out = None
    for i, a in enumerate(seq):
        t = type(a)
        if t is Tensor or t is _Parameter:
            if a.dtype in src:
                c = cast(a)  # a plain tensor's cast raising is an error to see
                if out is None:
                    out = list(seq)
                out[i] = c
        elif a is None or t is bool or t is str:  # an absent bias, a flag: nothing to cast or check
            continue
        elif t is int or t is float:
            if limit is not None and limit < abs(a) < _INF:  # inline: no frame per number
                return None
        elif t is list or t is tuple:
            b = cast_each(a, src, cast, limit)
            if b is None:
                return None
            if b is not SAME:
                if out is None:
                    out = list(seq)
                out[i] = b
        elif isinstance(a, Tensor):
            if a.dtype in src:
                try:
                    c = cast(a)
                except Exception:
                    continue  # a subclass that refuses the cast stays uncast
                if out is None:
                    out = list(seq)
                out[i] = c
        elif limit is not None and is_number(t) and limit < abs(float(a)) < _INF:  # numpy's: by their exact value
            return None
    if out is None:
        return SAME
    return out if type(seq) is list else tuple(out)


def cast_seq(seq, src, cast, limit=None):
    """``cast_each``, giving ``seq`` itself when nothing was cast."""
    cast_values = cast_each(seq, src, cast, limit)
    return seq if cast_values is SAME else cast_values


_Parameter = torch.nn.Parameter


def cast_kwargs(kwargs, src, cast):
    """``cast_seq`` for keyword arguments: ``kwargs`` itself when nothing was cast."""
    cast_values = cast_each(tuple(kwargs.values()), src, cast)
    return kwargs if cast_values is SAME else dict(zip(kwargs, cast_values))


def cast_nothing(args, kwargs):
    """The policy of a call left as given."""
    return args, kwargs


def to_dtype(src, cast, out=None):
    """Cast every tensor argument whose dtype is in ``src`` with ``cast``; a
    call with ``out=`` goes to ``out`` instead (the in-place rule)."""

    def prepare(args, kwargs):
        if not kwargs:
            cast_args = cast_each(args, src, cast)
            return (args if cast_args is SAME else cast_args), kwargs
        if out is not None and kwargs.get("out") is not None:
            return out(args, kwargs)
        return _split(args, kwargs, cast_each((*args, *kwargs.values()), src, cast))

    return prepare


def _split(args, kwargs, cast_both):
    """A call's ``(args, kwargs)`` from one scan of both (a frame per call, not one per side)."""
    if cast_both is SAME:
        return args, kwargs
    n = len(args)
    return tuple(cast_both[:n]), dict(zip(kwargs, cast_both[n:]))


def lower(low, casters, out=None):
    """BF16 list: float32 tensors go to the lower dtype. A call given a Python number the
    lower dtype cannot hold as a finite value (``torch.finfo(torch.float32).min``, a
    usual mask fill) runs under the FP32 rule instead (docs/never-changes.md)."""
    cast, limit = casters[low].any, overflow_limit(low)
    up = fp32(low, casters, out)

    def prepare(args, kwargs):
        if not kwargs:
            cast_args = cast_seq(args, FP32_ONLY, cast, limit)
            return up(args, kwargs) if cast_args is None else (cast_args, kwargs)
        if out is not None and kwargs.get("out") is not None:
            return out(args, kwargs)
        both = tuple(args) + tuple(kwargs.values())  # one scan: a factor and its tensor may sit on either side
        cast_both = cast_each(both, FP32_ONLY, cast, limit)
        if cast_both is None:
            return up(args, kwargs)
        if cast_both is SAME:  # (inline: one frame fewer on the BF16 rule's keyword calls)
            return args, kwargs
        n = len(args)
        return tuple(cast_both[:n]), dict(zip(kwargs, cast_both[n:]))

    return prepare


def lower_tensors(low, casters):
    """float32 tensors to the lower dtype, numbers unchecked: a module's
    inputs (a BF16 module's ops check their own numbers)."""
    return to_dtype(FP32_ONLY, casters[low].any)


def fp32(low, casters, out=None):
    """FP32 list: bfloat16 and float16 tensors go to float32."""
    return to_dtype(HALVES, casters[FP32].any, out)


def lower_input_only(low, casters, out=None):
    """Normalization ops: only the input is cast; weight, bias and running
    statistics keep their dtype (BatchNorm's running stats stay fp32)."""
    cast = casters[low].any

    def prepare(args, kwargs):
        if kwargs and out is not None and kwargs.get("out") is not None:
            return out(args, kwargs)
        if args:
            x = args[0]
            if isinstance(x, Tensor) and x.dtype is FP32:
                args = cast_seq(args[:1], FP32_ONLY, cast) + args[1:]
        elif kwargs:
            x = kwargs.get("input")
            if isinstance(x, Tensor) and x.dtype is FP32:
                kwargs = dict(kwargs, input=cast_seq((x,), FP32_ONLY, cast)[0])
        return args, kwargs

    return prepare


def _floating_dtypes(seq, seen, dimensioned=False):
    """``seen`` with the floating dtypes of the tensors in ``seq`` (at any
    depth) added; ``dimensioned``: of tensors with at least one dimension."""
    for a in seq:
        if isinstance(a, Tensor):
            d = a.dtype
            if d in FLOATS and (not dimensioned or a.dim()):
                seen.add(d)
        elif type(a) is list or type(a) is tuple:
            _floating_dtypes(a, seen, dimensioned)
    return seen


def one_dtype(seq, seen):
    """The one floating dtype of the tensors in ``seq`` (at any depth) and
    ``seen`` (a dtype or None), None when there is none, False when there
    are two or more."""
    for a in seq:
        if isinstance(a, Tensor):
            d = a.dtype
            if d in FLOATS:
                if seen is None:
                    seen = d
                elif d is not seen:
                    return False
        elif type(a) is list or type(a) is tuple:
            seen = one_dtype(a, seen)
            if seen is False:
                return False
    return seen


def widest(args, kwargs):
    """The floating dtype ``torch.result_type`` would give the tensor arguments, or None
    when they share one (or have none). As in torch, 0-dim tensors decide only when no
    dimensioned tensor is floating; Python scalars never count."""
    one = one_dtype(args, None)
    if one is not False and kwargs:
        one = one_dtype(kwargs.values(), one)
    if one is not False:  # one floating dtype or none: the common case, one pass
        return None
    # mixed dtypes (rare): dimensioned tensors decide, else every floating one
    values = (args, tuple(kwargs.values())) if kwargs else (args,)
    dims = iter(_floating_dtypes(values, set(), True) or _floating_dtypes(values, set()))
    dt = next(dims)
    for d in dims:
        dt = _promote_types(dt, d)
    return dt


def promote(low, casters, out=None):
    """Promote list: every floating tensor goes to the dtype torch's type
    promotion gives them (``widest``); 0-dim ones are cast too, so ops that
    insist on one dtype (index_put, lerp) get it."""

    def prepare(args, kwargs):
        if kwargs and out is not None and kwargs.get("out") is not None:
            return out(args, kwargs)
        dt = widest(args, kwargs)
        if dt is None:  # one floating dtype or none: the common case, one pass
            return args, kwargs
        src, cast = OTHER_FLOATS[dt], casters[dt].any
        return _split(args, kwargs, cast_each((*args, *kwargs.values()), src, cast))

    return prepare


def _first_tensor(value):
    if isinstance(value, Tensor):
        return value
    if type(value) is list or type(value) is tuple:
        for v in value:
            if isinstance(v, Tensor):
                return v
    return None


def _into(leader, args, kwargs, casters, unmoved=()):
    """Cast every floating argument except ``leader`` (and the written ones
    at the positions in ``unmoved``) to ``leader``'s dtype."""
    if leader is None or leader.dtype not in FLOATS:
        return args, kwargs
    dst = leader.dtype
    src, cast = OTHER_FLOATS[dst], casters[dst].any
    # leader already has dtype dst, so it is never in src and never copied
    cast_args = cast_each(args, src, cast)
    if cast_args is SAME:
        cast_args = args
    elif unmoved:
        cast_args = list(cast_args)
        for i in unmoved:
            if i < len(args):
                cast_args[i] = args[i]
        cast_args = tuple(cast_args)
    if kwargs:
        out = kwargs.get("out")
        if out is None:
            kwargs = cast_kwargs(kwargs, src, cast)
        else:  # every out tensor is written as given, never a cast copy
            rest = dict(kwargs)
            del rest["out"]
            kwargs = dict(cast_kwargs(rest, src, cast), out=out)
    return cast_args, kwargs


def inplace_self(casters):
    """``X_`` and ``__iX__``: the first argument is written."""

    def prepare(args, kwargs):
        leader = args[0] if args else None
        return _into(leader if isinstance(leader, Tensor) else None, args, kwargs, casters)

    return prepare


def inplace_out(casters):
    """A call with ``out=``: the out tensor is written."""

    def prepare(args, kwargs):
        return _into(_first_tensor(kwargs["out"]), args, kwargs, casters)

    return prepare


def inplace_input(casters):
    """A call with ``inplace=True``: the input (first argument) is written."""

    def prepare(args, kwargs):
        leader = args[0] if args else kwargs.get("input")
        return _into(leader if isinstance(leader, Tensor) else None, args, kwargs, casters)

    return prepare


def checking_inplace(main, into, position):
    """``main``, except for calls with ``inplace=True`` (positional at
    ``position``, or by keyword): those follow the in-place rule."""

    def prepare(args, kwargs):
        if len(args) > position:
            inplace = args[position]
        else:
            inplace = kwargs.get("inplace", False) if kwargs else False
        return into(args, kwargs) if inplace else main(args, kwargs)

    return prepare


def written_into(written, main, casters):
    """``main``, unless it would replace a tensor the op writes (``written``, from its
    schema) by a cast copy: then the call runs in the written tensor's dtype, the other
    floating arguments cast to it."""
    positions = tuple(i for i, _ in written)

    def prepare(args, kwargs):
        a, k = main(args, kwargs)
        for i, name in written:  # (no `a is args` shortcut: dynamo cannot compare two tuples' identity)
            if i < len(args):
                leader, copy = args[i], a[i]
            elif name in kwargs:
                leader, copy = kwargs[name], k.get(name)
            else:
                continue
            if copy is not leader and isinstance(leader, Tensor):
                return _into_written(leader, args, kwargs, casters, written, positions)
        return a, k

    return prepare


def _into_written(leader, args, kwargs, casters, written, positions):
    apart = {name: kwargs[name] for i, name in written if i >= len(args) and name in kwargs}
    a, k = _into(
        leader, args, {n: v for n, v in kwargs.items() if n not in apart} if apart else kwargs, casters, positions
    )
    return a, (dict(k, **apart) if apart else k)


def given_lower(args, kwargs):
    """True for a call given a lower-precision tensor: where an op in no
    list with no kernel for the lower dtype steps in (the FP32 rule,
    lists.fallback_names). Any other call runs as if hmp had not wrapped it."""
    return bool(_floating_dtypes((args, tuple(kwargs.values())), set()) & HALVES)


def given_mixed(args, kwargs):
    """True for a call given floating tensors of two dtypes: where an op in
    no list that needs one dtype steps in (the promote rule)."""
    return widest(args, kwargs) is not None


def as_given(low, casters, out=None):
    """A call left to torch, but for ``out=`` (the in-place rule): an op in no
    list that may need one dtype runs as given, and only where its kernel
    rejects the mix are its arguments promoted (sites.one_dtype_on_reject)."""

    def prepare(args, kwargs):
        if kwargs and out is not None and kwargs.get("out") is not None:
            return out(args, kwargs)
        return args, kwargs

    return prepare


def chosen(choose, rules, fallback=None):
    """The prepare of an op whose call picks its kernel (binding/picked.py): the rule of the entry
    ``choose(args, kwargs)`` names, else ``fallback`` (the rule of an op in no list; a call with
    neither is left alone by ``chosen_needs``)."""

    def prepare(args, kwargs):
        i = choose(args, kwargs)
        return (fallback if i is None else rules[i])(args, kwargs)

    return prepare


def chosen_needs(choose, fallback_needs=None, traced_only=False):
    """``needs`` of an op whose call picks its kernel: a call that picks a listed entry, or one the
    fallback's ``needs`` takes; ``traced_only``: eager calls are its builtin's wrapper's to decide."""

    def needs(args, kwargs):
        return choose(args, kwargs) is not None or fallback_needs is not None and fallback_needs(args, kwargs)

    if not traced_only:
        return needs

    def traced_needs(args, kwargs):
        return _dynamo_compiling() and needs(args, kwargs)

    return traced_needs


def through(cast):
    """Habana's ``op_wrap`` rule: every tensor argument, positional, keyword or inside a list or
    tuple, passed through ``cast``."""

    def cast_value(v):
        if isinstance(v, torch.Tensor):
            return cast(v)
        if type(v) is list or type(v) is tuple:
            return type(v)(cast_value(x) for x in v)
        return v

    def prepare(args, kwargs):
        return tuple(cast_value(a) for a in args), {k: cast_value(v) for k, v in kwargs.items()}

    return prepare


def _dtypes(args, kwargs):
    out = []

    def visit(v):
        if isinstance(v, torch.Tensor):
            out.append(dtypes.name(v.dtype))
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
