"""Optimizer steps run with casts off, as if inside ``disable_casts()``,
without the user writing it; and every step drops the weight-cast cache.

torch's global optimizer step hooks do the work: the pre hook turns casts
off in the stepping thread (remembering the level it found) and the post
hook puts that level back and empties the cache. A closure (LBFGS) runs
the forward and backward pass inside ``step()``, so it is wrapped to run
at the level found at step entry: casts on, unless the step itself was
called inside ``disable_casts()``.

An exception inside ``step()`` skips the post hook. torch runs the hooks
and the step inside one ``torch.autograd.profiler.record_function`` block,
so hmp installs (through the patch log) a subclass whose ``__exit__``
unwinds any step level entered inside it that is still open. No optimizer
object or class is modified.
"""

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .cache import clear_cache
from .casts import run_as, saved
from .state import tls

_record_function = torch.autograd.profiler.record_function


def _pre_hook(optimizer, args, kwargs):
    st = tls
    caller = saved()
    st.step_levels.append(st.off)
    st.off += 1
    # the closure (LBFGS) passes its arguments on, for optimizers that give any
    if kwargs and kwargs.get("closure") is not None:
        return args, dict(kwargs, closure=run_as(kwargs["closure"], caller))
    if len(args) > 1 and callable(args[1]):  # args[0] is the optimizer
        return (args[0], run_as(args[1], caller)) + tuple(args[2:]), kwargs
    return None


def _post_hook(optimizer, args, kwargs):
    levels = tls.step_levels
    if levels:
        tls.off = levels.pop()
    clear_cache()


def _unwind(depth):
    """Leave every step entered since ``depth`` steps were in progress."""
    levels = tls.step_levels
    if len(levels) > depth:
        tls.off = levels[depth]
        del levels[depth:]
        clear_cache()  # the step may have written some weights before it failed


class record_function(_record_function):
    __doc__ = _record_function.__doc__

    def __enter__(self):
        self._hmp_steps = len(tls.step_levels)
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            return super().__exit__(exc_type, exc_value, traceback)
        finally:
            # normally the post hook has already left the step; this catches
            # an exception, and a revert() inside the step (hooks gone)
            _unwind(getattr(self, "_hmp_steps", 0))


record_function.__name__ = record_function.__qualname__ = _record_function.__name__
record_function.__module__ = _record_function.__module__


def patches():
    """``[(namespace, attr, value)]``: the record_function that unwinds a failed step."""
    return [(torch.autograd.profiler, "record_function", record_function)]


def add_hooks():
    """Register the step hooks; returns their handles (``remove()`` each)."""
    return [register_optimizer_step_pre_hook(_pre_hook), register_optimizer_step_post_hook(_post_hook)]
