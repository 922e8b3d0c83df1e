"""What a wrapper does when its op raises: no new errors.

When torch reports that the op has no kernel for the dtype hmp cast to
(``"addmm_..." not implemented for 'BFloat16'``, e.g. sparse matmul on
CPU), the op is run again with its arguments as given, as if it were in no
list, or, when that fails too and the call writes none of its arguments,
with its lower-precision arguments in float32 (an earlier listed op may have
made them bf16); hmp warns once per op. Only when the op itself raised that
error (a C function, so nothing ran before the kernel was chosen) and hmp
had cast something. Any other error is raised as it was, with the note
hmp/diagnostics/errors.py adds to a dtype mismatch.

Everything here runs only on the error path, from the wrapper's ``except``
clause (free in Python 3.11 when nothing is raised).
"""

import re
import warnings
from typing import NamedTuple, Optional

from hmp.core import culprit, dtypes, state, torch_private
from hmp.core.cast_copies import PLAIN_CASTS
from hmp.core.dtypes import FP32
from hmp.core.policy import fp32

RAISE = object()  # rescue(): the wrapper re-raises its exception

# what adds a note to an error the wrapper re-raises: registered from the floor above
# (hmp/diagnostics/errors.py), so the core imports nothing of it
_annotators = []


def on_error(annotate):
    """Have ``annotate(exc, wrapped)`` called on every error a wrapper re-raises."""
    if annotate not in _annotators:
        _annotators.append(annotate)
    return annotate


class Wrapped(NamedTuple):
    """What the error path knows of the callable a wrapper wraps: a listed
    site (``of(binding)``), a user function or an ``op_wrap``."""

    label: str  # torch.nn.functional.layer_norm
    name: Optional[str] = None  # the list name, layer_norm (None for op_wrap and user functions)
    kind: Optional[str] = None  # "bf16", "fp32" or "promote" (None for op_wrap)
    inplace: bool = False  # X_ / __iX__: the first argument is written
    inplace_param: Optional[int] = None  # position of an inplace= parameter
    written: tuple = ()  # positions of other arguments the op's schema marks written

    @classmethod
    def of(cls, binding):
        """The Wrapped of a resolve.Binding (a site a list name binds)."""
        site, kind, name = binding[:3]
        return cls(site.label, name, kind, site.inplace, site.inplace_param, site.written)

    def writes(self, args, kwargs):
        """True when this call writes one of its arguments."""
        if self.inplace or (kwargs and (kwargs.get("out") is not None or kwargs.get("inplace"))):
            return True
        if any(i < len(args) and args[i] is not None for i in self.written):
            return True
        i = self.inplace_param
        return i is not None and len(args) > i and bool(args[i])


_NO_KERNEL = re.compile(torch_private.NO_KERNEL_MESSAGE)
_to_fp32 = fp32(None, PLAIN_CASTS)


def rescue(exc, op, wrapped, args, kwargs, cast_args, cast_kwargs):
    """A result for a call whose op raised ``exc``, or RAISE (after noting
    ``exc``). ``args``/``kwargs`` are the call as given, ``cast_*`` as hmp
    changed it; casting is still off in this thread."""
    try:
        cast_something = cast_args is not args or cast_kwargs is not kwargs
        if (
            cast_something
            and isinstance(exc, (NotImplementedError, RuntimeError))
            and exc.args
            and _NO_KERNEL.search(str(exc.args[0]))
            and culprit.raised_by_the_op(exc)
        ):
            result, how = _without_the_cast(op, wrapped, args, kwargs)
            if how is not None:
                label = wrapped.label if wrapped else getattr(op, "__name__", repr(op))
                if state.first_time(("no kernel", label)):
                    first = str(exc.args[0]).splitlines()[0]
                    warnings.warn(
                        f"hmp: {label} has no kernel for the dtype hmp cast its inputs to ({first}); "
                        f"it ran {how}. Call it inside hmp.disable_casts() or change its list to "
                        f"silence this.",
                        RuntimeWarning,
                        stacklevel=state.user_stacklevel(),
                    )
                return result
    except Exception:
        pass
    for annotate in _annotators:
        annotate(exc, wrapped)
    return RAISE


def _without_the_cast(op, wrapped, args, kwargs):
    """Run the op with its arguments as given, or else (when it writes none
    of them) with its lower-precision arguments in float32. Returns
    ``(result, how)``; ``how`` is None when both fail."""
    try:
        return op(*args, **kwargs), "with its inputs as given"
    except Exception:
        pass
    if wrapped is None or wrapped.writes(args, kwargs):
        return None, None  # a written tensor is never replaced by a copy
    up_args, up_kwargs = _to_fp32(args, kwargs)
    if up_args is args and up_kwargs is kwargs:
        return None, None
    try:
        return op(*up_args, **up_kwargs), f"in {dtypes.name(FP32)}"
    except Exception:
        return None, None
