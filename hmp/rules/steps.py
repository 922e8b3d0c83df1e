"""Optimizer steps run with casts off, as if inside ``disable_casts()``,
without the user writing it; and every step drops the weight-cast cache.

torch's global optimizer step hooks do the work: the pre hook turns casts
off in the stepping thread (remembering the state it found) and the post
hook puts that state back and empties the cache. A closure (LBFGS) runs
the forward and backward pass inside ``step()``, so it is wrapped to run
in the state found at step entry: casts on, unless the step itself was
called inside ``disable_casts()``.

An exception inside ``step()`` skips the post hook. torch runs the hooks
and the step inside one ``torch.autograd.profiler.record_function`` block,
so hmp extends (through the patch log) that class's ``__enter__`` and
``__exit__``: the exit unwinds any step entered inside the block that
is still open. The class itself stays torch's (torch.compile knows it by
identity); no optimizer object or class is modified. A revert() inside a
step unwinds the calling thread's open steps itself (``forget_open_steps``).
"""

import warnings
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from hmp.core.cache import clear_cache
from hmp.core.casts import run_as
from hmp.core.resolve import stand_in, unwrap
from hmp.core.state import OFF, current, enter, first_time, leave, tls, user_stacklevel

_checked = weakref.WeakSet()  # optimizers whose parameters were looked at
_LOW = (torch.bfloat16, torch.float16)


def _warn_without_master_weights(optimizer):
    """Once per optimizer: parameters it updates in a lower dtype mean there
    are no float32 master weights, so the run is pure low-precision training
    rather than mixed precision; say so, with the fix."""
    _checked.add(optimizer)
    low = sorted(
        {
            str(p.dtype).replace("torch.", "")
            for group in optimizer.param_groups
            for p in group["params"]
            if p.requires_grad and p.dtype in _LOW
        }
    )
    if low and first_time(("no master weights", type(optimizer))):
        warnings.warn(
            f"hmp: {type(optimizer).__name__} updates {' and '.join(low)} parameters: there are no float32 "
            f"master weights, so this is pure {low[0]} training, not mixed precision (updates below the "
            f"parameters' rounding step are lost). Load the model in float32 (transformers: "
            f"from_pretrained(..., dtype=torch.float32); or model.float()) and let hmp cast per op. "
            f"(hmp warns once.)",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def _pre_hook(optimizer, args, kwargs):
    if optimizer not in _checked:
        _warn_without_master_weights(optimizer)
    caller = current()
    tls.steps.append(enter(OFF))
    # the closure (LBFGS) passes its arguments on, for optimizers that give any
    if kwargs and kwargs.get("closure") is not None:
        return args, dict(kwargs, closure=run_as(kwargs["closure"], caller))
    if len(args) > 1 and callable(args[1]):  # args[0] is the optimizer
        return (args[0], run_as(args[1], caller)) + tuple(args[2:]), kwargs
    return None


def _post_hook(optimizer, args, kwargs):
    steps = tls.steps
    if steps:
        leave(steps.pop())
    clear_cache()


def _unwind(depth):
    """Leave every step entered since ``depth`` steps were in progress."""
    steps = tls.steps
    if len(steps) > depth:
        for frame in reversed(steps[depth:]):
            leave(frame)
        del steps[depth:]
        clear_cache()  # the step may have written some weights before it failed


_STEPS = "_hmp_steps"  # on a record_function entered while converted: the open steps at its entry


def _enter(original):
    def __enter__(self):
        setattr(self, _STEPS, len(tls.steps))
        return original(self)

    return stand_in(__enter__, original)


def _exit(original):
    def __exit__(self, exc_type, exc_value, traceback):
        try:
            return original(self, exc_type, exc_value, traceback)
        finally:
            # normally the post hook has already left the step; this catches
            # an exception. A block entered before convert() unwinds nothing.
            depth = getattr(self, _STEPS, None)
            if depth is not None:
                _unwind(depth)

    return stand_in(__exit__, original)


def forget_open_steps():
    """revert() in the calling thread: leave every step it is inside (their
    post hooks and record_function exits are torch's own after revert)."""
    _unwind(0)


def patches(ctx):
    """``[(namespace, attr, value)]``: record_function's enter and exit, extended to unwind a failed step."""
    cls = torch.autograd.profiler.record_function
    return [
        (cls, "__enter__", _enter(unwrap(cls.__dict__["__enter__"]))),
        (cls, "__exit__", _exit(unwrap(cls.__dict__["__exit__"]))),
    ]


def hooks(ctx):
    """Register the step hooks; returns their handles (``remove()`` each)."""
    return [register_optimizer_step_pre_hook(_pre_hook), register_optimizer_step_post_hook(_post_hook)]
