"""Turning hmp's casts off and on for a block, in the calling thread.

Each switch saves the thread's state where its block starts and puts it
back on every exit path, so blocks nest and exceptions cannot leak a state.
"""

import contextlib

from .resolve import stand_in
from .state import tls


def casts_enabled():
    """True when hmp wrappers would cast in the calling thread right now."""
    return tls.off == 0


class disable_casts(contextlib.ContextDecorator):
    """Turn hmp casting off for a block or a function, in this thread only.

    Nestable and exception-safe: leaving an inner block keeps the outer one
    disabled, and the previous state is restored on every exit path.
    """

    def __enter__(self):
        tls.off += 1
        return self

    def __exit__(self, *exc):
        tls.off -= 1
        return False


class enable_casts(contextlib.ContextDecorator):
    """Turn hmp casting on for a block or a function, in this thread only:
    the counterpart of :class:`disable_casts`, for code that runs inside a
    disabled block but should cast (a training step called from a loop
    that runs with casts off). Restores the previous state on exit."""

    _saved = None

    def _recreate_cm(self):
        return type(self)()  # as a decorator: a fresh instance per call, so threads never share one

    def __enter__(self):
        if self._saved is not None:
            raise RuntimeError("hmp: an enable_casts() instance is already in use; enter a new one")
        self._saved = tls.off
        tls.off = 0
        return self

    def __exit__(self, *exc):
        tls.off, self._saved = self._saved, None
        return False


def saved():
    """The calling thread's cast state, for ``run_as``."""
    st = tls
    return st.off, st.module_off, st.lower_mode


def run_as(fn, state):
    """``fn`` run in the cast state ``saved()`` returned (the state some
    earlier code ran in: a checkpointed forward, the code that asked for an
    optimizer step), a BF16 module's mode pushed again if it was on; the
    caller's state is back afterwards."""
    mode = state[2]

    def run(*args, **kwargs):
        st = tls
        before = st.off, st.module_off, st.lower_mode
        st.off, st.module_off, st.lower_mode = state
        try:
            if mode is not None and before[2] is not mode:  # its forward ran inside a BF16 module
                with mode:
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        finally:
            st.off, st.module_off, st.lower_mode = before

    return run


def uncast(fn):
    """``fn`` run with casts off, as inside ``disable_casts()``: for code
    hmp runs uncast by itself (weight updates, backward, loss scaling).
    Carries ``fn``'s metadata and points ``ORIGINAL`` at it."""

    def uncast(*args, **kwargs):
        st = tls
        st.off += 1
        try:
            return fn(*args, **kwargs)
        finally:
            st.off -= 1

    return stand_in(uncast, fn)
