"""Turning hmp's casts off and on for a block, in the calling thread.

Each switch saves the thread's state where its block starts and puts it
back on every exit path, so blocks nest and exceptions cannot leak a state.
"""

import contextlib
import functools
import inspect
import sys
import threading
import types
import warnings

from hmp.core import torch_private
from hmp.core.identity import stand_in
from hmp.core.state import OFF, enter, leave, tls


def casts_enabled() -> bool:
    """True when hmp wrappers would cast in the calling thread right now."""
    return tls.off == 0


class _Switch(contextlib.ContextDecorator):
    """A block that sets the thread's ``off`` to ``_to`` and puts back what
    it found on every exit path. One instance may be entered nested or from
    several threads: what each entry found is kept per thread."""

    _to = OFF

    def __new__(cls, func=None):
        """``@hmp.disable_casts`` without parentheses decorates ``func`` as
        ``@hmp.disable_casts()`` does."""
        self = super().__new__(cls)
        if func is None:
            return self
        if not callable(func):
            raise TypeError(
                f"hmp.{cls.__name__}() takes no argument (use it as `with hmp.{cls.__name__}():` or as a "
                f"decorator of a function), got {func!r}"
            )
        self._found, self._unused_at = {}, None
        return self(func)

    def __init__(self, func=None):
        self._found = {}  # thread id -> [what enter() returned], innermost last
        # where it was made, until it is entered or decorates: `hmp.disable_casts()` alone on a
        # line does nothing, which __del__ says instead of letting it pass silently
        # (not while torch.compile traces: dynamo cannot trace sys._getframe, and would break the graph)
        if torch_private.compiling():
            self._unused_at = None
            return
        caller = sys._getframe(1)
        self._unused_at = (caller.f_code.co_filename, caller.f_lineno, caller.f_globals.get("__name__"))

    def __del__(self):
        made_at = getattr(self, "_unused_at", None)
        if made_at is not None:
            name = type(self).__name__
            warnings.warn_explicit(
                f"hmp.{name}() was called but never entered, so it changed nothing: write "
                f"`with hmp.{name}():` around the block, or use it as a decorator",
                UserWarning,
                made_at[0],
                made_at[1],
                module=made_at[2],
            )

    def _recreate_cm(self):
        cm = type(self)()  # as a decorator: a fresh instance per call
        cm._unused_at = None
        return cm

    def __call__(self, func):
        self._unused_at = None
        # A generator's or coroutine's body runs in steps, after the call has
        # returned: the switch is on for each step only, so the caller's code
        # between steps (other asyncio tasks during an await) keeps its state.
        # The wrapper is of func's kind, so decorators stacked above it (a
        # torch.no_grad()) still see a generator or coroutine function.
        if inspect.isasyncgenfunction(func):

            @functools.wraps(func)
            async def switched(*args, **kwargs):
                switch, agen = self._recreate_cm(), func(*args, **kwargs)
                resume, arg = agen.asend, None
                while True:
                    try:
                        value = await _steps(switch, resume(arg))
                    except StopAsyncIteration:
                        return
                    try:
                        arg, resume = (yield value), agen.asend
                    except BaseException as exc:  # athrow(), aclose(): into the body
                        arg, resume = exc, agen.athrow

        elif inspect.isgeneratorfunction(func):

            @functools.wraps(func)
            def switched(*args, **kwargs):
                return (yield from _steps(self._recreate_cm(), func(*args, **kwargs)))

        elif inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def switched(*args, **kwargs):
                return await _steps(self._recreate_cm(), func(*args, **kwargs).__await__())

        else:
            return super().__call__(func)
        return switched

    def __enter__(self):
        self._unused_at = None
        self._found.setdefault(_thread(), []).append(enter(self._to))
        return self

    def __exit__(self, *exc):
        thread = _thread()
        found = self._found.get(thread)
        if found:  # none: entered in another thread, whose state it switched
            leave(found.pop())
            if not found:
                del self._found[thread]
        return False


def _thread():
    # torch.compile traces one thread and cannot trace get_ident (it would break the graph there)
    return 0 if torch_private.compiling() else threading.get_ident()


@types.coroutine  # awaitable too: a coroutine's steps are driven the same way
def _steps(switch, gen):
    """Runs ``gen`` (a generator, or a coroutine's ``__await__()``) to its
    end, each resumption (send, throw, close) inside ``switch``; what it
    yields and returns passes through unchanged."""
    resume, arg = gen.send, None
    while True:
        try:
            with switch:
                value = resume(arg)
        except StopIteration as stop:
            return stop.value
        try:
            arg, resume = (yield value), gen.send
        except BaseException as exc:  # throw(), close() (GeneratorExit): into the body
            arg, resume = exc, gen.throw


class disable_casts(_Switch):
    """Turn hmp casting off for a block or a function, in this thread only.

    Nestable and exception-safe: leaving an inner block keeps the outer one
    disabled, and the previous state is restored on every exit path.

    As a decorator it covers a function's call, and each step of a
    generator, coroutine or async generator function's body (between steps,
    other code and other asyncio tasks run in the caller's state).
    """


class enable_casts(_Switch):
    """Turn hmp casting on for a block or a function, in this thread only:
    the counterpart of :class:`disable_casts`, for code that runs inside a
    disabled block but should cast (a training step called from a loop
    that runs with casts off). Restores the previous state on exit. As a
    decorator it covers what :class:`disable_casts` covers."""

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
