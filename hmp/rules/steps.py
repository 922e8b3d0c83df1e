"""Optimizer steps run with casts off, as if inside ``disable_casts()``, and every step
drops the weight-cast cache.

torch's global step hooks do it: the pre hook turns casts off (keeping what it
found), the post hook restores it and empties the cache. A closure (LBFGS) runs in
the state found at step entry.

An exception inside ``step()`` skips the post hook, so hmp extends what the
``record_function`` block's exit operator calls (``record_function_exit_call``): a
block closed from the frame a still-open step's pre hook ran in means that step
raised, and it is left there. record_function and the operator object stay torch's
(compile knows them by identity); no optimizer is modified. revert() inside a step
unwinds the thread's open steps (``forget_open_steps``)."""

import sys
import warnings
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from hmp.core import dtypes, torch_private
from hmp.core.cache import clear_cache
from hmp.core.delegation import drop
from hmp.core.identity import stand_in, unwrap
from hmp.core.state import OFF, current, enter, first_time, leave, tls, user_stacklevel
from hmp.core.switches import run_as
from hmp.rules.interface import Changes

# kept: the optimizers already looked at (weak: goes with them)
_checked = weakref.WeakSet()  # optimizers whose parameters were looked at
_is_compiling = torch.compiler.is_compiling
# torch's record_function.__exit__ (hmp leaves it as it is): the frame that calls it owns the block
_EXIT_CODE = torch.autograd.profiler.record_function.__dict__["__exit__"].__code__
_REACH = 8  # frames from the operator's call up to record_function.__exit__, at most


def _warn_without_master_weights(optimizer):
    """Once per optimizer: parameters it updates in a lower dtype mean there
    are no float32 master weights, so the run is pure low-precision training
    rather than mixed precision; say so, with the fix."""
    _checked.add(optimizer)
    low = sorted(
        {
            dtypes.name(p.dtype)
            for group in optimizer.param_groups
            for p in group["params"]
            if p.requires_grad and p.dtype in dtypes.LOW
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
    # a compiled step skips the once-per-optimizer look (dynamo before 2.5 cannot trace a WeakSet):
    # the optimizer's first eager step takes it
    if not _is_compiling() and optimizer not in _checked:
        _warn_without_master_weights(optimizer)
    caller = current()
    # the frame calling the hooks holds the step's record_function block; torch.compile
    # cannot trace frame access, and a compiled step runs no block
    owner = None if _is_compiling() else sys._getframe(1)
    tls.steps.append((enter(OFF, graph=False), owner))
    drop()  # engine="autocast": autocast's copies were made from the weights the step writes
    # the closure (LBFGS) passes its arguments on, for optimizers that give any
    if kwargs and kwargs.get("closure") is not None:
        return args, dict(kwargs, closure=run_as(kwargs["closure"], caller))
    if len(args) > 1 and callable(args[1]):  # args[0] is the optimizer
        return (args[0], run_as(args[1], caller)) + tuple(args[2:]), kwargs
    return None


def _post_hook(optimizer, args, kwargs):
    steps = tls.steps
    if steps:
        leave(steps.pop()[0], graph=False)
    clear_cache()


def _unwind(depth):
    """Leave every step entered since ``depth`` steps were in progress."""
    steps = tls.steps
    if len(steps) > depth:
        for frame, _ in reversed(steps[depth:]):
            leave(frame, graph=False)
        del steps[depth:]
        clear_cache()  # the step may have written some weights before it failed


def _leave_failed_step(frame):
    """A record_function block closed (``frame`` called its exit operator).
    If the frame that called its ``__exit__`` is where an open step's pre
    hook was called from, that is the step's own block: its post hook
    did not run (the step raised), so the step, and any step still open
    inside it, is left now. Any other block (inside a step, or around one)
    leaves the steps as they are."""
    for _ in range(_REACH):
        if frame is None:
            return
        if frame.f_code is _EXIT_CODE:
            owner, steps = frame.f_back, tls.steps
            for i in range(len(steps) - 1, -1, -1):
                if steps[i][1] is owner:
                    _unwind(i)
                    return
            return
        frame = frame.f_back


class _Closing:
    """What the exit operator calls while converted: torch's operator, then
    a failed step is left. It hashes as torch's operator does: the operator
    object hashes as what it calls, and torch's compilers look it up by that
    hash in their tables (fx's side-effectful functions, inductor's)."""

    def __init__(self, original):
        self.call = original

    def __call__(self, *args, **kwargs):
        try:
            return self.call(*args, **kwargs)
        finally:
            if tls.steps:  # no step open in this thread: nothing to look at
                _leave_failed_step(sys._getframe(1))

    def __hash__(self):
        return hash(self.call)


def forget_open_steps():
    """revert() in the calling thread: leave every step it is inside (their
    post hooks and the exit operator are torch's own after revert)."""
    _unwind(0)


def _patches(ctx):
    """``[(namespace, attr, value)]``: what record_function's exit operator
    calls, extended to leave a step that raised ([] on a torch where it is
    not found; convert() then says so, through ``needs()``)."""
    site = torch_private.record_function_exit_call()
    if site is None:
        return []
    overload, name = site
    original = unwrap(vars(overload)[name])
    return [(overload, name, stand_in(_Closing(original), original))]


def changes(ctx):
    """The rule's changes (hmp/rules/interface.py): the exit operator's patch and the step hooks."""
    hooks = (lambda: register_optimizer_step_pre_hook(_pre_hook), lambda: register_optimizer_step_post_hook(_post_hook))
    return Changes(tuple(_patches(ctx)), hooks, tuple(torch_private.step_lacks()))
