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

import threading

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .cache import cache
from .state import tls

_record_function = torch.autograd.profiler.record_function


class _Steps(threading.local):
    def __init__(self):
        self.levels = []  # tls.off found at the entry of each step in progress, outermost first


_steps = _Steps()


def _closure_at(closure, level):
    def closure_with_casts(*args, **kwargs):  # passes arguments on, for optimizers that give any
        saved = tls.off
        tls.off = level
        try:
            return closure(*args, **kwargs)
        finally:
            tls.off = saved

    return closure_with_casts


def _pre_hook(optimizer, args, kwargs):
    level = tls.off
    _steps.levels.append(level)
    tls.off = level + 1
    if kwargs and kwargs.get("closure") is not None:
        return args, dict(kwargs, closure=_closure_at(kwargs["closure"], level))
    if len(args) > 1 and callable(args[1]):  # args[0] is the optimizer
        return (args[0], _closure_at(args[1], level)) + tuple(args[2:]), kwargs
    return None


def _post_hook(optimizer, args, kwargs):
    levels = _steps.levels
    if levels:
        tls.off = levels.pop()
    cache.clear()


def _unwind(depth):
    """Leave every step entered since ``depth`` steps were in progress."""
    levels = _steps.levels
    if len(levels) > depth:
        tls.off = levels[depth]
        del levels[depth:]
        cache.clear()  # the step may have written some weights before it failed


class record_function(_record_function):
    __doc__ = _record_function.__doc__

    def __enter__(self):
        self._hmp_steps = len(_steps.levels)
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


class StepHooks:
    """The installed hooks; ``remove()`` takes them out."""

    def __init__(self, patches):
        patches.setattr(torch.autograd.profiler, "record_function", record_function)
        self._handles = [register_optimizer_step_pre_hook(_pre_hook), register_optimizer_step_post_hook(_post_hook)]

    def remove(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []
