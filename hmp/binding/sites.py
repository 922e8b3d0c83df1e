"""What each site's wrapper does, decided once per site at convert time
(``Wrappers``): its rule's casts, the lean path for calls without keywords,
where a kernel rejects mixed dtypes the retry in one dtype (core/rescue.py),
the verbose log (core/policy.py), the recorder of profile/audit/tune; and
the wrappers ``@hmp.*_function`` and ``op_wrap`` return. The wrapper's body is
hmp/core/wrap.py's."""

from typing import Callable

import torch

from hmp.binding import picked
from hmp.binding.pays import NORMALIZATIONS
from hmp.binding.resolve import BUILTINS
from hmp.binding.wrapper_life import finish, make
from hmp.core import policy, rescue
from hmp.core.cast_copies import Cast, overflow_limit
from hmp.core.rescue import About
from hmp.core.wrap import NEVER, PAUSED


def about_of(binding):
    """The error path's About of a resolve.Binding (a site a list name binds)."""
    site = binding.site
    return About(site.label, binding.name, binding.kind, site.inplace, site.inplace_param, site.written)


def one_dtype_on_reject(op, to_one):
    """``op`` run as given; where the device's kernel rejects the mix of dtypes, again with
    ``to_one``'s, and straight there from then on for that device type and mix (CPU's
    layer_norm takes a bf16 input with float32 weight, CUDA's does not)."""
    return finish(rescue.one_dtype_on_reject(op, to_one), op)


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
        # the casters' eager forms as casters: a wrapper's rules in eager code (wrapper_life.make's eager_prepare)
        self.eager_casters = {dtype: Cast(c.eager, c.eager) for dtype, c in casters.items()}

    def _prepare(self, prepare, label, name):
        if self.passthrough:
            prepare = policy.cast_nothing
        if self.verbose:
            prepare = policy.logged(prepare, label)
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
        kind = binding.kind
        prepare = for_site(kind, name, site, self.low, self.casters, self.strict, fallback)
        plain = not (self.passthrough or self.verbose or self.recorder is not None)  # else every call alike
        eager = for_site(kind, name, site, self.low, self.eager_casters, self.strict, fallback) if plain else None
        op = original
        to_one = one_dtype_rule(kind, name, site, self.low, self.casters, fallback)
        if to_one is not None and not self.passthrough:
            op = one_dtype_on_reject(op, to_one)
        about = about_of(binding)
        hidden = not isinstance(original, BUILTINS)
        op = self._op(op)
        # an op in no list steps in only for a call that needs it: otherwise the ops it calls cast as usual
        needs = factory(fallback_of(kind).needs) if fallback else None
        lean = self._lean(site, kind, name, fallback)
        if lean is None:
            prepare = self._prepare(prepare, site.label, name)
            return make(op, prepare, about, original, hidden=hidden, needs=needs, eager_prepare=eager)
        return make(op, prepare, about, original, *lean, hidden=hidden, eager_prepare=eager)

    def _picked(self, binding, original):
        """The wrapper of an op whose call picks its kernel (hmp/binding/picked.py):
        a call that reaches a listed op's computation gets that entry's rule,
        built here for each list; any other runs as torch's."""
        site, name = binding.site, binding.name
        choose = picked.chooser(original, binding.picks, self.low)
        # an entry's name changes its rule only for a normalisation (for_site): one rule per list else
        made, rules = {}, []
        for _, kind, listed in binding.picks:
            shown = listed if listed in NORMALIZATIONS else ""
            if (kind, shown) not in made:
                made[kind, shown] = for_site(kind, shown, site, self.low, self.casters, self.strict)
            rules.append(made[kind, shown])

        op, fallback, fallback_needs = original, None, None
        if binding.fallback:  # a call that picks no kernel entry: the rule of an op in no list (kinds.Fallback)
            kind = binding.kind
            fallback = for_site(kind, name, site, self.low, self.casters, self.strict, True)
            fallback_needs = factory(fallback_of(kind).needs)
            to_one = one_dtype_rule(kind, name, site, self.low, self.casters, True)
            if to_one is not None and not self.passthrough:
                op = one_dtype_on_reject(op, to_one)

        prepare = policy.chosen(choose, rules, fallback)
        # traced only: eager calls are its builtin's wrapper's to decide, given what picks the kernel
        needs = policy.chosen_needs(choose, fallback_needs, binding.traced_only)
        about = about_of(binding)
        hidden = not isinstance(original, BUILTINS)
        return make(self._op(op), self._prepare(prepare, site.label, name), about, original, hidden=hidden, needs=needs)

    def _lean(self, site, kind, name, fallback):
        """The lean path of a site (decided here only): ``(src, cast, limit, inplace_at)`` for
        wrapper_life.make, so a call without keywords skips ``prepare``; None where every call goes
        through ``prepare`` (logged or recorded, writes a tensor, a strict norm, an op in no list)."""
        if self.passthrough or self.verbose or self.recorder is not None:
            return None
        if site.inplace or site.written or fallback or kind.norms is not None and name in NORMALIZATIONS:
            return None
        at = NEVER if site.inplace_param is None else site.inplace_param
        lean = kind.lean
        if lean.one_dtype:
            return policy.PROMOTE, None, None, at
        to = self.low if lean.to is None else lean.to
        return lean.src, self.casters[to], overflow_limit(self.low) if lean.numbers else None, at

    def user_prepare(self, kind, label):
        """The prepare of a user function (``@hmp.*_function``) of list ``kind`` (a kinds.Kind)."""
        rule = for_kind(kind, self.low, self.casters)
        return self._prepare(rule, label, f"user_{kind.name}_function")


def user_function(fn, kind):
    """The wrapper ``@hmp.{kind}_function`` returns; paused until convert()
    resumes it with that conversion's prepare."""
    label = getattr(fn, "__qualname__", None) or repr(fn)
    return make(fn, PAUSED, About(label, None, kind))


def op_wrap(op: Callable, cast_fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """Habana's public helper: a wrapper of ``op`` that passes every tensor
    argument (positional, keyword, or inside a list/tuple) through
    ``cast_fn`` before calling it. It follows ``disable_casts`` and the
    outermost-op rule like every hmp wrapper, converted or not."""
    return make(op, policy.through(cast_fn), About(getattr(op, "__qualname__", None) or repr(op)))


# -- which prepare a site's wrapper calls, decided once per site --

# Norms without running statistics. Some devices' kernels reject a bf16 input
# with fp32 weight and bias (CUDA's layer_norm); under strict=True, which casts
# a norm's input, these retry with weight and bias cast too (one_dtype_on_reject).
AFFINE_ONLY_NORMS = frozenset(("layer_norm", "group_norm", "rms_norm", "native_layer_norm", "native_group_norm"))


# policy.py's factories by the names kinds.Kind records give (a record holds names, so kinds.py
# imports nothing of the call path): a table, so a name no factory has fails here, not by getattr
POLICIES = {
    f.__name__: f
    for f in (
        policy.lower,
        policy.fp32,
        policy.promote,
        policy.lower_input_only,
        policy.given_lower,
        policy.given_mixed,
        policy.as_given,
    )
}


def factory(name):
    """The factory of hmp/core/policy.py a kind's record names."""
    return POLICIES[name]


def for_kind(kind, low, casters):
    """The rule of list ``kind`` (a kinds.Kind) for a whole call (user functions, registered ops)."""
    return factory(kind.policy)(low, casters, policy.inplace_out(casters))


def for_site(kind, name, site, low, casters, strict=False, fallback=False):
    """The one prepare for calls of ``site`` (a resolve.Site) bound by list
    entry ``name`` of list ``kind`` (a kinds.Kind); ``strict``: Habana's
    literal rule (a normalisation is bound only then, and only its input is
    cast); ``fallback``: an op in no list (lists.fallback_names), which gets
    the kind's fallback rule."""
    if site.inplace:
        return policy.inplace_self(casters)
    out = policy.inplace_out(casters)
    chosen = kind.policy
    if kind.norms is not None and name in NORMALIZATIONS:
        chosen = kind.norms
    elif fallback:
        chosen = fallback_of(kind).policy or chosen
    main = factory(chosen)(low, casters, out)
    if site.written:
        main = policy.written_into(site.written, main, casters)
    if site.inplace_param is None:
        return main
    return policy.checking_inplace(main, policy.inplace_input(casters), site.inplace_param)


def fallback_of(kind):
    """``kind``'s rule for an op in no list (kinds.Fallback); a ValueError for a kind that has none."""
    if kind.fallback is None:
        raise ValueError(f"hmp: the {kind.name} list gives no rule to an op in no list")
    return kind.fallback


def one_dtype_rule(kind, name, site, low, casters, fallback):
    """The rule that puts every floating argument in one dtype where the kernel rejects the
    mix, or None: for a strict lower-list norm without running statistics, and an op in
    no list whose kind retries (all to the widest; a written tensor's dtype if it writes one)."""
    if kind.norms is not None and name in AFFINE_ONLY_NORMS:
        return factory(kind.policy)(low, casters)
    retry = fallback_of(kind).retry if fallback else None
    if retry is not None and not site.inplace:
        to_one = factory(retry)(low, casters)
        return policy.written_into(site.written, to_one, casters) if site.written else to_one
    return None
