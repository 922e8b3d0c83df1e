"""What each site's wrapper does, decided once per site at convert time
(``Wrappers``): its rule's casts, the lean path for calls without keywords,
a normalisation's output rounding and its retry where a kernel rejects mixed
dtypes, the verbose log, the recorder of profile/audit/tune; and the wrapper
``@hmp.*_function`` returns. The wrapper itself is hmp/core/wrap.py's."""

import logging

import torch

from hmp.core import cast_copies, culprit, dtypes, policy
from hmp.core.rescue import Wrapped
from hmp.core.resolve import BUILTINS
from hmp.core.wrap import NEVER, PROMOTE, finish, make, op_of

log = logging.getLogger("hmp")


def _mentions_dtype(error):
    text = str(error).lower()
    return "dtype" in text or "scalar type" in text


def mixed_or_lower(op, lower_all):
    """``op`` for a norm whose input alone was cast. Where the device's kernel
    rejects mixed dtypes, retry with weight and bias cast too, and from then
    on go straight there for that device type."""
    return finish(_mixed_or_lower(op, lower_all), op)


def _mixed_or_lower(op, lower_all):
    unsupported = set()

    def call(*args, **kwargs):
        x = args[0] if args else kwargs.get("input")
        device = x.device.type if isinstance(x, torch.Tensor) else None
        if device in unsupported:
            args, kwargs = lower_all(args, kwargs)
            return op(*args, **kwargs)
        try:
            return op(*args, **kwargs)
        except RuntimeError as e:
            if not _mentions_dtype(e):
                raise
            cast_args, cast_kwargs = lower_all(args, kwargs)
            if cast_args is args and cast_kwargs is kwargs:
                raise  # nothing left to cast: not a mixed-dtype problem
            result = op(*cast_args, **cast_kwargs)
            unsupported.add(device)
            log.info(
                "hmp: %s rejects mixed dtypes on %s; casting weight and bias too", getattr(op, "__name__", op), device
            )
            return result

    return call


culprit.register_wrapper(_mixed_or_lower(None, None).__code__, op_of)


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
        site, kind, name, fallback = binding
        prepare = policy.for_site(kind, name, site, self.low, self.casters, self.strict)
        op = original
        if policy.rejects_mixed(kind, name) and not self.passthrough:
            op = mixed_or_lower(op, policy.lower(self.low, self.casters))
        rounds = policy.rounds_output(kind, name, self.strict)
        output = policy.round_output(cast_copies.CASTS[self.low]) if rounds and not self.passthrough else None
        if output is not None and self.recorder is not None:
            output = self.recorder.output(output)
        wrapped = Wrapped.of(binding)
        hidden = not isinstance(original, BUILTINS)
        op = self._op(op)
        # an op in no list steps in only for a call that needs it: otherwise the ops it calls cast as usual
        needs = policy.needs(kind) if fallback else None
        if (
            self.passthrough
            or self.verbose
            or self.recorder is not None
            or site.inplace
            or site.written
            or rounds
            or name in policy.NORM_OPS
            and kind == "bf16"
            or fallback
        ):
            return make(
                op,
                self._prepare(prepare, site.label, name),
                wrapped,
                original,
                hidden=hidden,
                needs=needs,
                output=output,
            )
        # lean for calls without keywords: the rule's casts without the prepare call
        at = NEVER if site.inplace_param is None else site.inplace_param
        if kind == "bf16":
            src, cast, refuse = dtypes.FP32_ONLY, self.casters[self.low], cast_copies.numbers_check(self.low)
        elif kind == "fp32":
            src, cast, refuse = dtypes.HALVES, self.casters[dtypes.FP32], None
        else:
            src, cast, refuse = PROMOTE, None, None
        return make(op, prepare, wrapped, original, src, cast, refuse, at, hidden)

    def user_prepare(self, kind, label):
        """The prepare of a user function (``@hmp.*_function``) of list ``kind``."""
        return self._prepare(policy.for_kind(kind, self.low, self.casters), label, f"user_{kind}_function")


def user_function(fn, kind):
    """The wrapper ``@hmp.{kind}_function`` returns; paused until convert()
    resumes it with that conversion's prepare."""
    label = getattr(fn, "__qualname__", None) or repr(fn)
    return make(fn, None, Wrapped(label, None, kind))  # paused: prepare None
