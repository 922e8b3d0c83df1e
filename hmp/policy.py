"""Cast policies: which arguments of a call are cast, and to which dtype.

Each policy is a small factory returning ``prepare(args, kwargs) ->
(args, kwargs)``. ``prepare`` returns its inputs unchanged (the same
objects) when nothing needs a cast, and never mutates them. ``casters`` maps a
dtype to a one-argument cast function; it is chosen at convert time (plain,
or through the weight cache). ``for_site`` picks the one prepare a wrapper
calls: the list's rule, with the in-place rule for calls that write a
tensor (``out=``, ``inplace=True``) checked inside it.
"""

import warnings

import torch

from . import state, torch_private

Tensor = torch.Tensor
FP16, BF16, FP32, FP64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
FLOATS = frozenset((FP16, BF16, FP32, FP64))
# every floating dtype but the key: what a cast *to* the key converts
OTHER_FLOATS = {d: FLOATS - {d} for d in FLOATS}
_promote_types = torch.promote_types  # captured: listing promote_types cannot recurse

# Casts go straight to TensorBase's C methods, never through a name hmp may
# patch (so listing `to` or `float` cannot recurse). The per-dtype methods
# parse their arguments faster than `to`; all of them are differentiable.
_TB = torch_private.TensorBase
PLAIN_CASTS = {FP16: _TB.half, BF16: _TB.bfloat16, FP32: _TB.float, FP64: _TB.double}

NORM_OPS = frozenset((
    "batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm",
    "native_batch_norm", "native_layer_norm", "native_group_norm",
))
# Norms without running statistics. Some devices' kernels reject a bf16 input
# with fp32 weight and bias (CUDA's layer_norm); there these fall back to
# casting weight and bias too (see wrap.mixed_or_lower).
AFFINE_ONLY_NORMS = frozenset(("layer_norm", "group_norm", "rms_norm", "native_layer_norm", "native_group_norm"))


def cast_seq(seq, src, cast, refuse=None):
    """``seq`` with every tensor whose dtype is in ``src`` passed through ``cast``.

    Looks into list/tuple items, at any depth (``torch.cat([a, b])``).
    Returns ``seq`` itself when nothing was cast. ``refuse``: a check of
    the Python numbers directly in ``seq``; when it says True, the result
    is None (the BF16 rule's overflow check: see ``lower``).
    """
    out = None
    for i, a in enumerate(seq):
        if isinstance(a, Tensor):
            if a.dtype in src:
                if out is None:
                    out = list(seq)
                out[i] = cast(a)
        elif type(a) is list or type(a) is tuple:
            b = cast_seq(a, src, cast)
            if b is not a:
                if out is None:
                    out = list(seq)
                out[i] = b
        elif refuse is not None and (type(a) is float or type(a) is int) and refuse(a):
            return None
    if out is None:
        return seq
    return out if type(seq) is list else tuple(out)


def cast_kwargs(kwargs, src, cast):
    """``cast_seq`` for keyword arguments: ``kwargs`` itself when nothing was cast."""
    values = tuple(kwargs.values())
    cast_values = cast_seq(values, src, cast)
    return kwargs if cast_values is values else dict(zip(kwargs, cast_values))


def cast_nothing(args, kwargs):
    """The policy of a call left as given."""
    return args, kwargs


def to_dtype(src, cast, out=None):
    """Cast every tensor argument whose dtype is in ``src`` with ``cast``; a
    call with ``out=`` goes to ``out`` instead (the in-place rule)."""

    def prepare(args, kwargs):
        if kwargs:
            if out is not None and kwargs.get("out") is not None:
                return out(args, kwargs)
            kwargs = cast_kwargs(kwargs, src, cast)
        return cast_seq(args, src, cast), kwargs

    return prepare


def overflow_limit(low):
    """Numbers beyond this magnitude are not finite values of ``low``. (The
    exact point where rounding reaches inf lies a little above it, and
    moves when a kernel rounds through float32 first: the largest finite
    value is the bound that holds for every kernel.)"""
    return torch.finfo(low).max


_INF = float("inf")
FP32_ONLY = frozenset((FP32,))
HALVES = frozenset((BF16, FP16))
MULTIPLICATIONS = frozenset(("mul", "multiply"))


def numbers_check(low, name):
    """The BF16 rule's check of a Python number: True (refuse the rule) for
    a finite number beyond the lower dtype's largest value. A multiplication
    also warns once about a factor within half the lower dtype's epsilon of
    1: the product rounds back to (about) the value multiplied, so a decay
    applied step after step never moves it."""
    limit = overflow_limit(low)
    half = torch.finfo(low).eps / 2
    near, far = 1 - half, 1 + half
    factor = name in MULTIPLICATIONS
    dtype = str(low).replace("torch.", "")

    def refuse(a):
        if factor and near < a < far and a != 1 and state.first_time(("factor near one", name)):
            warnings.warn(f"hmp: {name} by {a!r} runs in {dtype} (BF16 list), where multiplying by a number "
                          f"this close to 1 changes a value by at most its rounding step: a decay or moving "
                          f"average computed this way stalls. Update it in place (ema.lerp_(x, 1 - decay)) or "
                          f"inside hmp.disable_casts() (docs/never-changes.md). (hmp warns about this once.)",
                          UserWarning, stacklevel=state.user_stacklevel())
        return (a > limit or a < -limit) and a != _INF and a != -_INF

    return refuse


def lower(low, casters, out=None, name=None):
    """BF16 list: float32 tensors go to the lower dtype; nothing else is
    touched. A call given a Python number that the lower dtype cannot hold
    as a finite value (``torch.finfo(torch.float32).min``, the usual
    attention-mask fill, is -inf in bfloat16) runs under the FP32 rule
    instead: a finite value never turns inf (docs/never-changes.md).
    ``name``: the op, so a multiplication can warn about a factor near 1."""
    cast, refuse = casters[low], numbers_check(low, name)
    up = fp32(low, casters, out)

    def prepare(args, kwargs):
        cast_kw = kwargs
        if kwargs:
            if out is not None and kwargs.get("out") is not None:
                return out(args, kwargs)
            values = tuple(kwargs.values())
            cast_values = cast_seq(values, FP32_ONLY, cast, refuse)
            if cast_values is None:
                return up(args, kwargs)
            if cast_values is not values:
                cast_kw = dict(zip(kwargs, cast_values))
        cast_args = cast_seq(args, FP32_ONLY, cast, refuse)
        if cast_args is None:
            return up(args, kwargs)
        return cast_args, cast_kw

    return prepare


def lower_tensors(low, casters):
    """float32 tensors to the lower dtype, numbers unchecked: a module's
    inputs (a BF16 module's ops check their own numbers)."""
    return to_dtype(FP32_ONLY, casters[low])


def fp32(low, casters, out=None):
    """FP32 list: bfloat16 and float16 tensors go to float32."""
    return to_dtype(HALVES, casters[FP32], out)


def lower_input_only(low, casters, out=None):
    """Normalization ops: only the input is cast; weight, bias and running
    statistics keep their dtype (BatchNorm's running stats stay fp32)."""
    cast = casters[low]

    def prepare(args, kwargs):
        if kwargs and out is not None and kwargs.get("out") is not None:
            return out(args, kwargs)
        if args:
            x = args[0]
            if isinstance(x, Tensor) and x.dtype is FP32:
                args = (cast(x),) + args[1:]
        elif kwargs:
            x = kwargs.get("input")
            if isinstance(x, Tensor) and x.dtype is FP32:
                kwargs = dict(kwargs, input=cast(x))
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
    """The floating dtype ``torch.result_type`` would give the tensor
    arguments, or None when they share one dtype (or have none), so nothing
    needs a cast.

    As in torch, 0-dim tensors do not widen dimensioned ones: ``x +
    torch.tensor(0.5, dtype=torch.float64)`` stays in ``x``'s dtype, and
    only when no dimensioned tensor is floating do 0-dim ones decide.
    Python scalars are not tensors and never count."""
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
        src, cast = OTHER_FLOATS[dt], casters[dt]
        args = cast_seq(args, src, cast)
        if kwargs:
            kwargs = cast_kwargs(kwargs, src, cast)
        return args, kwargs

    return prepare


def _first_tensor(value):
    if isinstance(value, Tensor):
        return value
    if type(value) is list or type(value) is tuple:
        for v in value:
            if isinstance(v, Tensor):
                return v
    return None


def _into(target, args, kwargs, casters):
    """Cast every floating argument except ``target`` to ``target``'s dtype."""
    if target is None or target.dtype not in FLOATS:
        return args, kwargs
    dst = target.dtype
    src, cast = OTHER_FLOATS[dst], casters[dst]
    # target already has dtype dst, so it is never in src and never copied
    args = cast_seq(args, src, cast)
    if kwargs:
        out = kwargs.get("out")
        if out is None:
            kwargs = cast_kwargs(kwargs, src, cast)
        else:  # every out tensor is written as given, never a cast copy
            rest = dict(kwargs)
            del rest["out"]
            kwargs = dict(cast_kwargs(rest, src, cast), out=out)
    return args, kwargs


def inplace_self(casters):
    """``X_`` and ``__iX__``: the first argument is written."""

    def prepare(args, kwargs):
        target = args[0] if args else None
        return _into(target if isinstance(target, Tensor) else None, args, kwargs, casters)

    return prepare


def inplace_out(casters):
    """A call with ``out=``: the out tensor is written."""

    def prepare(args, kwargs):
        return _into(_first_tensor(kwargs["out"]), args, kwargs, casters)

    return prepare


def inplace_input(casters):
    """A call with ``inplace=True``: the input (first argument) is written."""

    def prepare(args, kwargs):
        target = args[0] if args else kwargs.get("input")
        return _into(target if isinstance(target, Tensor) else None, args, kwargs, casters)

    return prepare


def _checking_inplace(main, into, position):
    """``main``, except for calls with ``inplace=True`` (positional at
    ``position``, or by keyword): those follow the in-place rule."""

    def prepare(args, kwargs):
        if len(args) > position:
            inplace = args[position]
        else:
            inplace = kwargs.get("inplace", False) if kwargs else False
        return into(args, kwargs) if inplace else main(args, kwargs)

    return prepare


RULES = {"bf16": lower, "fp32": fp32, "promote": promote}  # list kind -> policy factory


def for_kind(kind, low, casters):
    """The rule of list ``kind`` for a whole call (user functions, registered ops)."""
    return RULES[kind](low, casters, inplace_out(casters))


def for_site(kind, name, site, low, casters):
    """The one prepare for calls of ``site`` (a resolve.Site) bound by list
    entry ``name`` of list ``kind``."""
    if site.inplace:
        return inplace_self(casters)
    if kind == "bf16":
        main = (lower_input_only(low, casters, inplace_out(casters)) if name in NORM_OPS
                else lower(low, casters, inplace_out(casters), name))
    else:
        main = RULES[kind](low, casters, inplace_out(casters))
    if site.inplace_param is None:
        return main
    return _checking_inplace(main, inplace_input(casters), site.inplace_param)


def rejects_mixed(kind, name):
    """True for a site whose kernel may reject its input cast alone (a BF16
    norm without running statistics: see wrap.mixed_or_lower)."""
    return kind == "bf16" and name in AFFINE_ONLY_NORMS
