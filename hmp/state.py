"""Per-thread casting state.

One integer per thread, ``off``, is all the per-call wrapper reads: it is
non-zero inside ``disable_casts()`` and while a wrapped op runs (so ops that
a listed op calls internally are not cast again: the outermost op decides).
"""

import contextlib
import threading

import torch

# -1 outside a backward pass; autograd's device threads run nothing else
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


class _ThreadState(threading.local):
    # class attribute: every new thread starts with casting on ...
    off = 0

    def __init__(self):
        # ... except one first seen inside a backward pass: an autograd
        # device thread (CUDA runs backward there), which only ever runs
        # backward, where hmp casts nothing. Runs once per thread.
        if _graph_task_id is not None and _graph_task_id() != -1:
            self.off = 1


tls = _ThreadState()

# Called when a thread leaves its outermost disable_casts() block (set by
# convert() to empty the weight-cast cache after an optimizer step).
on_reenable = None


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
        hook = on_reenable  # read once: revert() in another thread may clear it
        if tls.off == 0 and hook is not None:
            hook()
        return False
