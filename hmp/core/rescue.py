"""What a wrapper does when its op raises: no new errors.

When a listed torch op raises after hmp cast its arguments (no kernel for the dtype,
an algorithm the lower dtype breaks), the call runs again as given, or, if that fails
too and it writes no argument, with its lower-precision arguments in float32; hmp
warns once per op. The rule is a principle, not a list of messages: the error was
hmp's exactly when the call as given runs. A torch op runs nothing before it raises,
so a retry is safe; a user's function is retried only when its error came straight
out of a C function it called and names a missing kernel. Any other error is raised
as it was, with diagnostics/errors.py's note. Runs only on the error path."""

import logging
import re
import warnings
from typing import NamedTuple, Optional

import torch

from hmp.core import dtypes, state, torch_private, wrapper_frames
from hmp.core.cast_copies import ROUNDING_CASTS
from hmp.core.dtypes import FP32
from hmp.core.policy import fp32

log = logging.getLogger("hmp")
RAISE = object()  # rescue(): the wrapper re-raises its exception

# what adds a note to an error the wrapper re-raises: registered from the floor above
# (hmp/diagnostics/errors.py), so the core imports nothing of it
# kept: registrations made at import by the floor above, which core must not import
_annotators = []


def on_error(annotate):
    """Have ``annotate(exc, about)`` called on every error a wrapper re-raises."""
    if annotate not in _annotators:
        _annotators.append(annotate)
    return annotate


class About(NamedTuple):
    """What the error path knows of the callable a wrapper wraps: a listed
    site (binding/sites.py's ``about_of``), a user function or an ``op_wrap``."""

    label: str  # torch.nn.functional.layer_norm
    name: Optional[str] = None  # the list name, layer_norm (None for op_wrap and user functions)
    kind: object = None  # the list's kinds.Kind (None for op_wrap and an op whose call picks its kernel)
    inplace: bool = False  # X_ / __iX__: the first argument is written
    inplace_param: Optional[int] = None  # position of an inplace= parameter
    written: tuple = ()  # (position, name) of other arguments the op's schema marks written (resolve.writes)
    uncast: bool = False  # the call ran with casts off for a block (uncast_error)

    def writes(self, args, kwargs):
        """True when this call writes one of its arguments."""
        if self.inplace or (kwargs and (kwargs.get("out") is not None or kwargs.get("inplace"))):
            return True
        for i, name in self.written:
            if (args[i] if i < len(args) else kwargs.get(name) if kwargs else None) is not None:
                return True
        i = self.inplace_param
        return i is not None and len(args) > i and bool(args[i])


_NO_KERNEL = re.compile(torch_private.NO_KERNEL_MESSAGE)
_graph_task_id = torch_private.current_graph_task_id()
_to_fp32 = fp32(None, ROUNDING_CASTS)


def rescue(exc, op, about, args, kwargs, cast_args, cast_kwargs):
    """A result for a call whose op raised ``exc``, or RAISE (after noting
    ``exc``). ``args``/``kwargs`` are the call as given, ``cast_*`` as hmp
    changed it; casting is still off in this thread."""
    try:
        cast_something = cast_args is not args or cast_kwargs is not kwargs
        if cast_something and isinstance(exc, (NotImplementedError, RuntimeError)) and _may_run_again(exc, about):
            result, how = _without_the_cast(op, about, args, kwargs)
            if how is not None:
                label = about.label if about else getattr(op, "__name__", repr(op))
                if state.first_time(("no kernel", label)):
                    first = str(exc.args[0]).splitlines()[0] if exc.args else type(exc).__name__
                    warnings.warn(
                        f"hmp: {label} fails on the dtype hmp cast its inputs to ({first}); "
                        f"it ran {how}. Call it inside hmp.disable_casts() or change its list to "
                        f"silence this.",
                        RuntimeWarning,
                        stacklevel=state.user_stacklevel(),
                    )
                return result
    except Exception:
        pass
    for annotate in _annotators:
        annotate(exc, about)
    return RAISE


def uncast_error(exc, about):
    """An op a wrapper called with casts off raised ``exc``. With no enclosing wrapper (a
    ``disable_casts()`` block, an FP32 module) it gets a cast call's note, told the call
    ran uncast; inside another wrapper's op, that wrapper notes it."""
    if _graph_task_id is not None and _graph_task_id() != -1:
        return  # in a backward pass: the backward's wrapper notes it (hmp/rules/regions.py)
    tb = exc.__traceback__  # its first entry is the wrapper's own frame
    frame = tb.tb_frame.f_back if tb is not None else None
    while frame is not None:
        if frame.f_code in wrapper_frames.WRAPPER_CODES:
            return
        frame = frame.f_back
    for annotate in _annotators:
        annotate(exc, about._replace(uncast=True) if about is not None else None)


def _may_run_again(exc, about):
    """True when the call may simply be run again: torch's own op (a list
    entry's site), or a user's function whose error came straight out of the
    C function it called and names a missing kernel."""
    if about is not None and about.name is not None:
        return True
    return bool(exc.args) and bool(_NO_KERNEL.search(str(exc.args[0]))) and wrapper_frames.raised_by_the_op(exc)


def _without_the_cast(op, about, args, kwargs):
    """Run the op with its arguments as given, or else (when it writes none
    of them) with its lower-precision arguments in float32. Returns
    ``(result, how)``; ``how`` is None when both fail."""
    try:
        return op(*args, **kwargs), "with its inputs as given"
    except Exception:
        pass
    if about is None or about.writes(args, kwargs):
        return None, None  # a written tensor is never replaced by a copy
    up_args, up_kwargs = _to_fp32(args, kwargs)
    if up_args is args and up_kwargs is kwargs:
        return None, None
    try:
        return op(*up_args, **up_kwargs), f"in {dtypes.name(FP32)}"
    except Exception:
        return None, None


# -- a kernel that rejects a mix of dtypes ------------------------------------------------------


def _mix(args, kwargs):
    """The device type and the tensor arguments' dtypes, in order: what a kernel accepts or rejects."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return (tensors[0].device.type if tensors else None, *(t.dtype for t in tensors))


def one_dtype_on_reject(op, to_one):
    """``op`` run as given; where the device's kernel rejects the mix of dtypes, again with
    ``to_one``'s (one floating dtype), and straight there from then on for that device
    type and mix (binding/sites.py builds it)."""
    rejected = set()  # _mix keys whose kernel rejected the mix

    def call(*args, **kwargs):
        if rejected:  # (the key only once a kernel has rejected a mix: most sites never see one)
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
        mix = _mix(args, kwargs)
        rejected.add(mix)
        name = getattr(op, "__name__", op)
        log.info("hmp: %s rejects mixed dtypes on %s; putting them in one dtype", name, mix[0])
        return result

    return call


wrapper_frames.register_wrapper(one_dtype_on_reject(None, None).__code__)
