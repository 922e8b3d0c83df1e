"""What hmp's rules say a call runs in, computed from the rules, never by
calling hmp's wrapper.

The rules, as docs/never-changes.md and docs/lists.md state them: a list
entry that gains from its rule casts (hmp/binding/pays.py decides which); the
BF16 rule takes float32 tensors to the lower dtype, and a call given a
number beyond that dtype's range runs under the FP32 rule instead; a
normalisation (strict mode) casts its input alone; the FP32 rule takes
bfloat16 and float16 tensors to float32; the promote rule takes every
floating tensor to the widest floating dtype (dimensioned tensors first, as
torch's type promotion ranks them); a call that writes a tensor (``X_``,
``__iX__``, ``out=``, ``inplace=True``, an argument torch's schema marks
written) runs in that tensor's dtype; an op in no list with no kernel for
the lower dtype gets the FP32 rule when given a lower-precision tensor, and
one that needs one dtype runs as given and is promoted only where its
kernel rejects the mix (the call in one dtype runs); a listed op of torch's
that fails on the dtype its rule chose runs with its inputs as given (then
in float32, where it writes nothing).

The rules decide what the op receives; torch's own op, run on those inputs
with hmp's casts off, says what it returns.
"""

import decimal
import numbers
import re
from typing import NamedTuple, Optional

import torch

from hmp.binding.pays import NORMALIZATIONS
from hmp.binding.picked import flat
from hmp.binding.resolve import BUILTINS
from hmp.binding.sites import AFFINE_ONLY_NORMS
from hmp.core import torch_private
from hmp.core.dtypes import FLOATS as FLOATING
from hmp.core.dtypes import FP32, first_floating
from hmp.core.dtypes import LOW as LOWER
from hmp.core.state import runtime
from hmp.core.switches import casts_enabled, disable_casts
from hmp.driver.queries import in_force
from hmp.testing import entries

_NO_KERNEL = re.compile(torch_private.NO_KERNEL_MESSAGE)


class Expected(NamedTuple):
    """What hmp's rules say of one call.

    ``dtype``: the dtype of the call's floating result (the first floating
    tensor of what it returns), or None where the rules leave the call to
    torch (``rule`` says why) or it returns no floating tensor.
    ``received``: the floating dtypes of the tensors the op receives, in
    argument order (positional, then keyword); None when left to torch
    (it receives them as given). ``rule``: which rule decided, in words.
    ``rescued``: set when the op fails on the dtype its rule chose (no
    kernel), so hmp runs it as given (or in float32): what torch said."""

    dtype: Optional[torch.dtype]
    rule: str
    received: Optional[tuple] = None
    rescued: Optional[str] = None

    @property
    def left_to_torch(self):
        return self.received is None


def expected_dtype(op, /, *args, **kwargs):
    """The dtype of ``op(*args, **kwargs)``'s floating result that hmp's rules
    give under the conversion in force, in this thread's cast state; None
    where the rules leave the call to torch (not converted, casts off, an
    entry that gains nothing from its list, an op in no list): then torch's
    promotion decides, from the inputs as given. Module entries aside (a
    call inside a BF16 or FP32 module entry follows that module's rule). The
    op is not run through hmp: torch's own op runs on copies of the inputs
    the rules give it, with hmp's casts off and the random stream put back."""
    return expected_call(op, *args, **kwargs).dtype


def expected_call(op, /, *args, **kwargs):
    """``expected_dtype``'s answer in full: an Expected."""
    conversion = in_force()
    if conversion is None:
        return Expected(None, "left to torch: not converted")
    if not casts_enabled():
        return Expected(None, "left to torch: hmp's casts are off in this thread")
    call = entries.call_of(op, args)
    bound = _bound(conversion, op, call, args, kwargs)
    if bound is None:
        return Expected(None, f"left to torch: {entries.why_left(conversion, call)}")
    return _Rules(conversion.options.low_precision_type, bound, call, kwargs).expect()


def rule_of(op, /, *args, **kwargs):
    """The list entry whose rule binds ``op(*args, **kwargs)`` under the
    conversion in force (an entries.Bound: its kind and name), or None where
    the call is left to torch (not converted, casts off, no entry binds it)."""
    conversion = in_force()
    if conversion is None or not casts_enabled():
        return None
    return _bound(conversion, op, entries.call_of(op, args), args, kwargs)


def _bound(conversion, op, call, args, kwargs):
    return entries.binding(conversion, op, call, runtime) or entries.picked_binding(conversion, call, args, kwargs)


# -- the arguments: tensors and numbers at any depth of list and tuple arguments ---------------


def _tensors(args, kwargs):
    return [v for v in flat((*args, *kwargs.values())) if isinstance(v, torch.Tensor)]


def _floating(args, kwargs):
    return [t for t in _tensors(args, kwargs) if t.dtype in FLOATING]


def _map(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if type(value) is list or type(value) is tuple:
        return type(value)(_map(v, fn) for v in value)
    return value


def _number(v):
    return not isinstance(v, bool) and isinstance(v, (numbers.Real, decimal.Decimal))


def _cast(t, dtype):
    """``t`` in ``dtype`` (a copy), or ``t`` itself where it already is, or
    where its class refuses the cast (a subclass such as MaskedTensor is then
    left as it is)."""
    if t.dtype == dtype:
        return t
    try:
        return t.detach().to(dtype)
    except Exception:
        if type(t) in (torch.Tensor, torch.nn.Parameter):
            raise
        return t


def _widest(args, kwargs):
    """The floating dtype torch's type promotion gives the floating tensors:
    those with dimensions decide, 0-dim ones only when there are none."""
    floating = _floating(args, kwargs)
    ranked = [t.dtype for t in floating if t.dim()] or [t.dtype for t in floating]
    widest = None
    for d in ranked:
        widest = d if widest is None else torch.promote_types(widest, d)
    return widest


class _Rules:
    """One call under one entries.Bound."""

    def __init__(self, low, bound, call, kwargs):
        self.low, self.bound, self.call = low, bound, call
        self.args, self.kwargs = call.args, dict(kwargs)

    # each rule: (args, kwargs) -> (args, kwargs), a tensor it casts replaced by a copy

    def _all(self, src, dst, args, kwargs):
        def to(t):
            return _cast(t, dst) if t.dtype in src else t

        return _map(args, to), {k: _map(v, to) for k, v in kwargs.items()}

    def lower(self, args, kwargs):
        """The BF16 rule: float32 to the lower dtype; a number beyond its range: the FP32 rule."""
        limit = torch.finfo(self.low).max
        for v in flat((*args, *kwargs.values())):
            if _number(v) and abs(float(v)) > limit and abs(float(v)) != float("inf"):
                return self.fp32(args, kwargs)
        return self._all((FP32,), self.low, args, kwargs)

    def fp32(self, args, kwargs):
        return self._all(LOWER, FP32, args, kwargs)

    def promote(self, args, kwargs):
        widest = _widest(args, kwargs)
        if widest is None:
            return args, kwargs
        return self._all(tuple(d for d in FLOATING if d != widest), widest, args, kwargs)

    def lower_input_only(self, args, kwargs):
        """A normalisation under the BF16 rule: its input alone goes down."""
        if args:
            return (self.lower((args[0],), {})[0][0], *args[1:]), kwargs
        if "input" in kwargs:
            return args, dict(kwargs, input=self.lower((kwargs["input"],), {})[0][0])
        return args, kwargs

    def as_given(self, args, kwargs):
        return args, kwargs

    def named(self, name):
        """The rule a kind's record names (kinds.py), by the name of hmp/core/policy.py's factory:
        this module's own rule of that name, written from the docs; a KeyError for one it lacks."""
        rules = (self.lower, self.fp32, self.promote, self.lower_input_only, self.as_given)
        return {rule.__name__: rule for rule in rules}[name]

    def into(self, leader, args, kwargs, unmoved=()):
        """Every floating argument but ``leader``, the written ones (positions
        ``unmoved``) and ``out=`` in ``leader``'s dtype."""
        if not isinstance(leader, torch.Tensor) or leader.dtype not in FLOATING:
            return args, kwargs
        dst = leader.dtype

        def to(t):
            return t if t is leader or t.dtype not in FLOATING else _cast(t, dst)

        args = tuple(a if i in unmoved else _map(a, to) for i, a in enumerate(args))
        return args, {k: v if k == "out" else _map(v, to) for k, v in kwargs.items()}

    # the rule of this call

    def writes(self):
        """The tensor this call writes in place of its result's dtype, or None."""
        args, kwargs, call = self.args, self.kwargs, self.call
        out = kwargs.get("out")
        if self.bound.whole_call:  # a decorated function: its list's rule, and out= (no schema, no inplace=)
            return next((t for t in flat((out,)) if isinstance(t, torch.Tensor)), None) if out is not None else None
        if call.inplace:
            return args[0] if args else None
        i = call.inplace_param
        if i is not None and (args[i] if len(args) > i else kwargs.get("inplace", False)):
            return args[0] if args else kwargs.get("input")
        if out is not None:
            return next((t for t in flat((out,)) if isinstance(t, torch.Tensor)), None)
        return None

    def main(self, args, kwargs):
        """The rule the kind's record gives the entry: its norms' rule for a normalisation, its
        fallback's for an op in no list (the promote list's: as given, promoted on rejection)."""
        kind, name = self.bound.kind, self.bound.name
        chosen = kind.policy
        if kind.norms is not None and name in NORMALIZATIONS:
            chosen = kind.norms
        elif self.bound.fallback:
            chosen = kind.fallback.policy or chosen
        return self.named(chosen)(args, kwargs)

    def needed(self):
        """An op in no list steps in only for a call that needs its rule (the record's fallback
        names when: given a lower-precision tensor, or given mixed floating dtypes)."""
        floating = {t.dtype for t in _floating(self.args, self.kwargs)}
        needs = {"given_lower": lambda: bool(floating & set(LOWER)), "given_mixed": lambda: len(floating) > 1}
        return needs[self.bound.kind.fallback.needs]()

    def rule(self):
        """``(args, kwargs, words)``: what the op receives, and why."""
        args, kwargs = self.args, self.kwargs
        leader = self.writes()
        if leader is not None:
            a, k = self.into(leader, args, kwargs)
            return a, k, "a written tensor: the call runs in its dtype"
        a, k = self.main(args, kwargs)
        written = () if self.bound.whole_call else self.call.written
        for i, key in written:  # a written argument is never replaced by a copy
            given, now = (args[i], a[i]) if i < len(args) else (kwargs.get(key), k.get(key))
            if isinstance(given, torch.Tensor) and now is not given:
                unmoved = {j for j, _ in self.call.written}
                apart = {n: kwargs[n] for j, n in self.call.written if j >= len(args) and n in kwargs}
                a, k = self.into(given, args, {n: v for n, v in kwargs.items() if n not in apart}, unmoved)
                return a, dict(k, **apart), "a written tensor: the call runs in its dtype"
        return a, k, f"{self.bound.kind.name} rule of {self.bound.name}"

    def retry(self):
        """The rule that puts every floating argument in one dtype where the
        kernel rejects a mix, or None."""
        kind, name = self.bound.kind, self.bound.name
        if kind.norms is not None and name in AFFINE_ONLY_NORMS:
            return self.named(kind.policy)
        retry = kind.fallback.retry if self.bound.fallback else None
        if retry is not None and not self.call.inplace:
            return self.named(retry)
        return None

    def expect(self):
        if self.bound.fallback and not self.needed():
            return Expected(None, f"left to torch: {self.bound.name} is in no list and this call needs no rule")
        a, k, words = self.rule()
        result, a, k, rescued = self.run(a, k)
        received = tuple(t.dtype for t in _floating(a, k))
        return Expected(first_floating(result), words, received, rescued)

    def run(self, a, k):
        """torch's op on copies of ``(a, k)``, with hmp's casts off and the
        random stream as it was: ``(result, args, kwargs, rescued)``."""
        fn, given = self.call.fn, (self.args, self.kwargs)
        try:
            return _run(fn, a, k), a, k, None
        except (RuntimeError, NotImplementedError) as e:
            error = e
        retry = self.retry()
        if retry is not None and isinstance(error, RuntimeError):  # the kernel rejected the mix iff one dtype runs
            one = retry(a, k)
            if any(x is not y for x, y in zip(_tensors(*one), _tensors(a, k))):
                try:
                    return _run(fn, *one), *one, None
                except Exception:
                    raise error from None
        cast = any(x is not y for x, y in zip(_tensors(a, k), _tensors(*given)))
        # fails on the dtype the rule chose: torch's own op runs again as given, else in float32; a
        # decorated function only where its C op itself says it has no kernel
        rerun = not self.bound.whole_call or (_NO_KERNEL.search(str(error)) and isinstance(fn, BUILTINS))
        if not (cast and rerun):
            raise error
        try:
            return _run(fn, *given), *given, f"{error}".splitlines()[0]
        except Exception:
            if self.writes() is not None or any(
                i < len(self.args) and self.args[i] is not None for i, _ in self.call.written
            ):
                raise error from None
        a, k = self.fp32(*given)
        try:
            return _run(fn, a, k), a, k, f"{error}".splitlines()[0]
        except Exception:
            raise error from None


def _copy(t):
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def _run(fn, args, kwargs):
    devices = sorted({t.device.index or 0 for t in _tensors(args, kwargs) if t.device.type == "cuda"})
    args, kwargs = _map(args, _copy), {k: _map(v, _copy) for k, v in kwargs.items()}
    with torch.random.fork_rng(devices=devices), disable_casts():
        return fn(*args, **kwargs)
