"""Regions of a program where hmp casts nothing (docs/leaves-alone.md). Each switches
the thread's cast state where it starts and ends (``state.enter``/``leave``), so the
per-call wrapper still reads one integer:

- **torch.autocast regions**, enabled or not: the author chose the precision there.
- **Backward**: the thread that starts it is off for the pass; autograd's device
  threads start off (core/state.py).
- **GradScaler** ``scale``/``unscale_``/``step``/``update``: the loss scale is fp32
  arithmetic.
- **DataLoader** loading, in worker processes (through torch's private
  ``_worker_loop``: ``worker_loop`` below) and in process.

``patches()`` builds every patch before convert() changes anything; revert() undoes
them through the patch log."""

import warnings

import torch
from torch.amp.autocast_mode import autocast

from hmp.binding.resolve import subclasses
from hmp.core import dtypes, state, torch_private
from hmp.core.cache import release
from hmp.core.delegation import backward_starts, drop
from hmp.core.identity import mark, stand_in, unwrap
from hmp.core.state import OFF, enter, leave, tls
from hmp.core.switches import uncast
from hmp.diagnostics import errors
from hmp.rules.interface import Changes

_GRAD_SCALER_METHODS = ("scale", "unscale_", "step", "update")


def _warn_enabled_region(region):
    warnings.warn(
        f"hmp: a torch.autocast region ({region.device}, {dtypes.name(region.fast_dtype)}) was "
        f"entered while hmp is converted. hmp casts nothing inside torch.autocast regions: autocast's own lists "
        f"apply there, as without hmp (docs/leaves-alone.md). (hmp warns about this once per process.)",
        UserWarning,
        stacklevel=state.user_stacklevel(),
    )


def _engines_own(region):
    """A region in the dtype and device engine="autocast" programs in this thread: not said (torch's
    checkpoint re-enters its forward's autocast state at each recompute)."""
    engine = tls.engine
    return (
        engine is not None and engine.in_force and region.device in engine.devices and region.fast_dtype == engine.dtype
    )


def _casts_another_dtype(region):
    """A region that casts, not in the engine's dtype and devices (a float16 region, say)."""
    return torch_private.autocast_enabled(region) and not _engines_own(region)


def _autocast_enter(original):
    def __enter__(self):
        another = _casts_another_dtype(self)
        if another and state.first_time("autocast region entered"):
            _warn_enabled_region(self)  # first: a warnings filter set to "error" changes nothing
        # before torch's own __enter__: engine="autocast" turns autocast off with hmp's casts, and the
        # region's own state must be what torch sets last (hmp/core/delegation.py)
        found = enter(OFF)
        if another:
            drop()  # autocast's cache is keyed by weight alone: the engine's copies are not this region's
        try:
            result = original(self)
        except BaseException:
            leave(found)
            raise
        tls.autocast_regions.append((id(self), found))
        return result

    return stand_in(__enter__, original)


def _autocast_exit(original):
    def __exit__(self, *exc):
        try:
            return original(self, *exc)
        finally:
            if _casts_another_dtype(self):
                drop()  # nor are its copies the engine's
            # only a region this thread entered under hmp puts a state back:
            # one entered before convert() leaves the thread's state as it is
            regions, key = tls.autocast_regions, id(self)
            for i in range(len(regions) - 1, -1, -1):
                if regions[i][0] == key:
                    leave(regions.pop(i)[1])
                    break

    return stand_in(__exit__, original)


def forget_open_regions():
    """revert() in the calling thread: regions it is inside stop counting,
    so their exits (by torch's own code after revert) leave no casts off."""
    regions = tls.autocast_regions
    if regions:
        for _, frame in reversed(regions):
            leave(frame)
        regions.clear()


def _uncast_backward(original):
    """``switches.uncast`` for a backward pass; an error raised in it gets the note
    for errors in backward (hmp/diagnostics/errors.py)."""

    def backward(*args, **kwargs):
        release()  # the copies graphs hold for reuse: a backward pass ends their forward
        backward_starts()  # engine="autocast": so do autocast's, outside accumulation()
        try:
            return original(*args, **kwargs)
        except Exception as e:
            errors.annotate(e, in_backward=True)
            raise

    return uncast(stand_in(backward, original))


def worker_loop(*args, **kwargs):
    """DataLoader's worker entry point while hmp is converted: a worker
    process casts nothing, however it was started. A module-level function,
    so ``spawn`` and ``forkserver`` pickle it by name and the worker runs it
    too, converted or not. The name is only ever read back by that parent's
    own workers, which import the same installed hmp: no older name
    (``hmp.regions``, before any release) needs to keep finding it."""
    enter(OFF)  # for the worker's life (never left): it does nothing but load data
    return unwrap(torch_private.worker_loop())(*args, **kwargs)


def _unwrapped_own(cls, name):
    return unwrap(cls.__dict__[name])


def changes(ctx):
    """The rule's changes (hmp/rules/interface.py): a patch for every region
    hmp leaves alone. Builds everything and changes nothing."""
    patches = [
        (autocast, "__enter__", _autocast_enter(_unwrapped_own(autocast, "__enter__"))),
        (autocast, "__exit__", _autocast_exit(_unwrapped_own(autocast, "__exit__"))),
    ]
    # backward() and grad() both call torch.autograd's global at call time,
    # also when imported by name before convert(); graph's is patched too
    # because torch.compiler's export tracing copies it back over autograd's
    homes = torch_private.engine_run_backward_homes()
    run = _uncast_backward(unwrap(getattr(*homes[0])))
    patches += [(namespace, attr, run) for namespace, attr in homes]
    for cls in subclasses(torch.amp.GradScaler):  # subclasses defined later are not reached
        for name in _GRAD_SCALER_METHODS:
            if name in cls.__dict__:
                patches.append((cls, name, uncast(_unwrapped_own(cls, name))))
    # marked as hmp's: unwrap() then finds torch's loop, also while converted (the worker calls it)
    mark(worker_loop, unwrap(torch_private.worker_loop()))
    patches.append((torch_private.WORKER_MODULE, torch_private.WORKER_LOOP, worker_loop))
    fetch = torch_private.single_process_fetch()
    if fetch is not None:
        patches.append((*fetch, uncast(_unwrapped_own(*fetch))))
    return Changes(tuple(patches))
