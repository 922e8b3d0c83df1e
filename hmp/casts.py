"""Turning hmp's casts off and on for a block, in the calling thread.

Each switch saves the thread's state where its block starts and puts it
back on every exit path, so blocks nest and exceptions cannot leak a state.
"""

import contextlib
import threading

from .resolve import stand_in
from .state import OFF, enter, leave, tls


def casts_enabled():
    """True when hmp wrappers would cast in the calling thread right now."""
    return tls.off == 0


class _Switch(contextlib.ContextDecorator):
    """A block that sets the thread's ``off`` to ``_to`` and puts back what
    it found on every exit path. One instance may be entered nested or from
    several threads: what each entry found is kept per thread."""

    _to = OFF

    def __init__(self):
        self._found = {}  # thread id -> [what enter() returned], innermost last

    def _recreate_cm(self):
        return type(self)()  # as a decorator: a fresh instance per call

    def __enter__(self):
        self._found.setdefault(threading.get_ident(), []).append(enter(self._to))
        return self

    def __exit__(self, *exc):
        thread = threading.get_ident()
        found = self._found.get(thread)
        if found:  # none: entered in another thread, whose state it switched
            leave(found.pop())
            if not found:
                del self._found[thread]
        return False


class disable_casts(_Switch):
    """Turn hmp casting off for a block or a function, in this thread only.

    Nestable and exception-safe: leaving an inner block keeps the outer one
    disabled, and the previous state is restored on every exit path.
    """


class enable_casts(_Switch):
    """Turn hmp casting on for a block or a function, in this thread only:
    the counterpart of :class:`disable_casts`, for code that runs inside a
    disabled block but should cast (a training step called from a loop
    that runs with casts off). Restores the previous state on exit."""

    _to = 0


def run_as(fn, state):
    """``fn`` run in the cast state ``state.current()`` returned (the state some
    earlier code ran in: a checkpointed forward, the code that asked for an
    optimizer step), a BF16 module's mode pushed again if it was on; the
    caller's state is back afterwards."""
    off, mode = state

    def run(*args, **kwargs):
        found = enter(off, mode)
        try:
            if mode is not None and found[1] is not mode:  # its forward ran inside a BF16 module
                with mode:
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        finally:
            leave(found)

    return run


def uncast(fn):
    """``fn`` run with casts off, as inside ``disable_casts()``: for code
    hmp runs uncast by itself (weight updates, backward, loss scaling).
    Carries ``fn``'s metadata and points ``ORIGINAL`` at it."""

    def uncast(*args, **kwargs):
        found = enter(OFF)
        try:
            return fn(*args, **kwargs)
        finally:
            leave(found)

    return stand_in(uncast, fn)
