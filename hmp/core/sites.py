"""What each site's wrapper does, decided once per site at convert time
(``Wrappers``): its rule's casts, the lean path for calls without keywords,
the retry in one dtype where a kernel rejects mixed dtypes, the verbose log,
the recorder of profile/audit/tune; and the wrapper ``@hmp.*_function``
returns. The wrapper itself is hmp/core/wrap.py's."""

import logging

import torch

from hmp.core import culprit, dtypes, kinds, picked, policy
from hmp.core.pays import NORMALIZATIONS
from hmp.core.rescue import About
from hmp.core.resolve import BUILTINS
from hmp.core.wrap import NEVER, PAUSED, finish, make, op_of

log = logging.getLogger("hmp")


def one_dtype_on_reject(op, to_one):
    """``op`` run with the arguments it is given; where the device's kernel
    rejects their mix of dtypes, run again with ``to_one``'s (every floating
    argument in one dtype), and from then on go straight there for that
    device type and mix. torch's kernel decides where it can: CPU's
    layer_norm takes a bf16 input with float32 weight, CUDA's does not."""
    return finish(_one_dtype_on_reject(op, to_one), op)


def _mix(args, kwargs):
    """The device type and the tensor arguments' dtypes, in order: what a kernel accepts or rejects."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return (tensors[0].device.type if tensors else None, *(t.dtype for t in tensors))


def _one_dtype_on_reject(op, to_one):
    rejected = set()  # _mix keys whose kernel rejected the mix

    def call(*args, **kwargs):
        mix = _mix(args, kwargs)
        if mix in rejected:
            args, kwargs = to_one(args, kwargs)
            return op(*args, **kwargs)
        try:
            return op(*args, **kwargs)
        except RuntimeError as e:
            one_args, one_kwargs = to_one(args, kwargs)
            if one_args is args and one_kwargs is kwargs:
                raise  # nothing to put in one dtype: not a mixed-dtype problem
            rejected_error = e
        # the kernel rejected the mix exactly when the call in one dtype runs (however torch words it:
        # "expected scalar type", "BFloat16 did not match Float"); else the error is the call's own
        try:
            result = op(*one_args, **one_kwargs)
        except Exception:
            raise rejected_error from None
        rejected.add(mix)
        name = getattr(op, "__name__", op)
        log.info("hmp: %s rejects mixed dtypes on %s; putting them in one dtype", name, mix[0])
        return result

    return call


culprit.register_wrapper(_one_dtype_on_reject(None, None).__code__, op_of)


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


class Wrappers:
    """What every wrapper of one conversion does, decided per site.

    ``casters``: dtype -> cast function (plain or through the weight cache);
    ``verbose`` logs every cast call; ``recorder`` (hmp/tools/record.py)
    instruments the wrappers for profile/audit/tune; ``passthrough`` makes
    them cast nothing while still recording (an audit's fp32 reference).
    """

    def __init__(self, low, casters, verbose=False, recorder=None, passthrough=False, strict=False):
        self.low, self.casters, self.verbose, self.recorder, self.passthrough, self.strict = (
            low,
            casters,
            verbose,
            recorder,
            passthrough,
            strict,
        )

    def _prepare(self, prepare, label, name):
        if self.passthrough:
            prepare = policy.cast_nothing
        if self.verbose:
            prepare = logged(prepare, label)
        if self.recorder is not None:
            prepare = self.recorder.prepare(prepare, name)
        return prepare

    def _op(self, op):
        return op if self.recorder is None else self.recorder.op(op)

    def site(self, binding, original):
        """The wrapper of ``original`` for a resolve.Binding."""
        site, name, fallback = binding.site, binding.name, binding.fallback
        if binding.picks:
            return self._picked(binding, original)
        kind = kinds.kind(binding.kind)  # an unknown kind raises here, before anything is built
        prepare = policy.for_site(kind, name, site, self.low, self.casters, self.strict, fallback)
        op = original
        to_one = policy.one_dtype_rule(kind, name, site, self.low, self.casters, fallback)
        if to_one is not None and not self.passthrough:
            op = one_dtype_on_reject(op, to_one)
        about = About.of(binding)
        hidden = not isinstance(original, BUILTINS)
        op = self._op(op)
        # an op in no list steps in only for a call that needs it: otherwise the ops it calls cast as usual
        needs = policy.fallback_of(kind).needs if fallback else None
        if not self._lean(site, kind, name, fallback):
            return make(op, self._prepare(prepare, site.label, name), about, original, hidden=hidden, needs=needs)
        # lean for calls without keywords: the rule's casts without the prepare call
        at = NEVER if site.inplace_param is None else site.inplace_param
        src, cast, refuse = kind.lean(self.low, self.casters)
        return make(op, prepare, about, original, src, cast, refuse, at, hidden)

    def _picked(self, binding, original):
        """The wrapper of an op whose call picks its kernel (hmp/core/picked.py):
        a call that reaches a listed op's computation gets that entry's rule,
        built here for each list; any other runs as torch's."""
        site, name = binding.site, binding.name
        choose = picked.chooser(original, binding.picks)
        # an entry's name changes its rule only for a normalisation (policy.for_site): one rule per list else
        rules = {}
        for _, kind, target in binding.picks:
            shown = target if target in NORMALIZATIONS else ""
            if (kind, shown) not in rules:
                rules[kind, shown] = policy.for_site(kinds.kind(kind), shown, site, self.low, self.casters, self.strict)

        def prepare(args, kwargs):
            kind, target = choose(args, kwargs)
            return rules[kind, target if target in NORMALIZATIONS else ""](args, kwargs)

        def needs(args, kwargs):
            return choose(args, kwargs) is not None

        about = About.of(binding)
        hidden = not isinstance(original, BUILTINS)
        return make(
            self._op(original), self._prepare(prepare, site.label, name), about, original, hidden=hidden, needs=needs
        )

    def _lean(self, site, kind, name, fallback):
        """True when a call without keywords may skip ``prepare`` and apply the
        list's rule to every argument directly: not a call that is logged or
        recorded, writes a tensor (the in-place rule), is a strict norm (its
        input alone is cast) or an op in no list (it steps in only where needed)."""
        if self.passthrough or self.verbose or self.recorder is not None:
            return False
        if site.inplace or site.written or fallback:
            return False
        return not (kind.norms is not None and name in NORMALIZATIONS)

    def user_prepare(self, kind, label):
        """The prepare of a user function (``@hmp.*_function``) of list ``kind``."""
        rule = policy.for_kind(kinds.kind(kind), self.low, self.casters)
        return self._prepare(rule, label, f"user_{kind}_function")


def user_function(fn, kind):
    """The wrapper ``@hmp.{kind}_function`` returns; paused until convert()
    resumes it with that conversion's prepare."""
    label = getattr(fn, "__qualname__", None) or repr(fn)
    return make(fn, PAUSED, About(label, None, kind))
