"""Everything hmp keeps between calls, in one place; imports nothing from hmp
but torch_private (a leaf too).

- ``tls``: per thread. ``off`` is the only thing the per-call wrapper
  reads: non-zero inside ``disable_casts()``, inside a listed op (so ops it
  calls are not cast again: the outermost op decides), inside an FP32
  module, in backward and in the other regions hmp leaves alone. The rest
  is bookkeeping of those regions, written where a region starts and ends.
- ``runtime``: the process-wide conversion. Only hmp/conversion.py writes
  it, under ``runtime.lock``.
- ``copies``: the weight-cast cache's stores (hmp/cache.py writes them).
- ``warned``: keys of the warn-once messages already given.
"""

import os
import sys
import threading
import weakref

import torch

from . import torch_private

# -1 outside a backward pass; autograd's device threads run nothing else
_graph_task_id = torch_private.current_graph_task_id()


class ThreadState(threading.local):
    # class attributes: every new thread starts with casting on ...
    off = 0
    module_off = 0  # the ``off`` an enclosing FP32 module set (modules.py); 0 outside one
    lower_mode = None  # the TorchFunctionMode of an enclosing BF16 module (modules.py), while pushed

    def __init__(self):
        # ... except one first seen inside a backward pass: an autograd
        # device thread (CUDA runs backward there), which only ever runs
        # backward, where hmp casts nothing. Runs once per thread.
        if _graph_task_id is not None and _graph_task_id() != -1:
            self.off = 1
        self.regions = {}  # id(autocast region) -> times this thread entered it under hmp (regions.py)
        self.step_levels = []  # ``off`` at the entry of each optimizer step in progress (steps.py)
        self.frozen_depth = 0  # frozen_weights() nesting (cache.py)
        self.frozen = None  # that block's stores, {dtype: {id(tensor): entry}}


tls = ThreadState()


class Runtime:
    """The current conversion and what it installed."""

    def __init__(self):
        self.lock = threading.RLock()
        self.patches = None  # patch.PatchLog, made by the first convert(); kept for retries of a failed undo
        self.conversion = None  # conversion.Conversion in force; None: not converted
        self.wrappers = None  # wrap.Wrappers of this conversion, for register() while converted
        self.hooks = []  # handles of torch's global hooks hmp registered (optimizer steps, buffers)
        self.pickle_names = {}  # id(function) -> (function, "module:attr") (pickling.py)
        self.log_restore = None  # puts the "hmp" logger back after a verbose conversion
        self.blocks = []  # open converted() blocks, oldest first: [configuration to restore] each
        # kept across conversions
        self.registered = []  # (owner, name, kind) from hmp.register()
        self.decorated = weakref.WeakKeyDictionary()  # @hmp.*_function wrapper -> kind


runtime = Runtime()


class Copies:
    """Lower-precision copies of weights (hmp/cache.py)."""

    def __init__(self):
        dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        self.live = {d: {} for d in dtypes}  # grad mode: dtype -> {id(tensor): entry}
        self.frozen = weakref.WeakSet()  # every thread's frozen_weights() stores
        self.dtypes = dtypes


copies = Copies()

warned = set()


def first_time(key):
    """True the first time ``key`` is seen in this process (warn once)."""
    if key in warned:
        return False
    warned.add(key)
    return True


_NOT_THE_USERS = tuple(os.path.dirname(os.path.abspath(f)) for f in (__file__, torch.__file__))  # hmp, torch


def _not_the_users(filename):
    folder = os.path.dirname(os.path.abspath(filename))
    return any(folder == top or folder.startswith(top + os.sep) for top in _NOT_THE_USERS)


def user_stacklevel():
    """``stacklevel`` for a warning raised inside hmp: the first frame
    outside hmp and torch, so the warning shows the user's line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _not_the_users(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level
