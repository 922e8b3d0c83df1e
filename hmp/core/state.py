"""Everything hmp keeps between calls, in one place (imports only the leaves
torch_private and torch_releases).

- ``tls``: per thread. ``off`` is all the per-call wrapper reads: ``OFF`` inside
  ``disable_casts()``, a listed op (the outermost op decides), backward and other
  regions hmp leaves alone; ``MODULE`` inside an FP32 module; 0 where hmp casts.
  Every writer pairs ``enter()`` with ``leave()`` on every exit path.
- ``runtime``: the process-wide conversion, written by hmp/driver/conversion.py
  under ``runtime.lock``.
- ``weight_cache``: the weight-cast cache's stores (hmp/core/cache.py).
- ``warned``: warn-once keys already given.

A store kept elsewhere says why with a ``# kept: ...`` line where it is defined
(tests/unit/test_one_home.py reads it)."""

import os
import sys
import sysconfig
import threading
import weakref

import torch

from hmp.core import torch_private, torch_releases

# -1 outside a backward pass; autograd's device threads run nothing else
_graph_task_id = torch_private.current_graph_task_id()


OFF = 1  # casts off: disable_casts(), an op in progress, backward, a step, a region hmp leaves alone
MODULE = 2  # casts off for an FP32 module's forward (module_rules.py): a BF16 module inside turns them on


class ThreadState(threading.local):
    # Attributes per thread, none on the class: dynamo before torch 2.12 traces a class
    # attribute in place of the thread's value (torch_releases.BOUNDARIES, below).
    def __init__(self):
        # casting on, except in an autograd device thread (first seen inside backward): it runs only backward
        self.off = OFF if _graph_task_id is not None and _graph_task_id() != -1 else 0
        self.lower_mode = None
        self.frames = []  # open regions' frames (enter/leave), oldest first
        self.autocast_regions = []  # [(id(autocast region), what enter() returned)] entered under hmp (regions.py)
        self.steps = []  # per step in progress: (what enter() returned, the frame calling its hooks) (steps.py)
        self.frozen_depth = 0  # frozen_weights() nesting (cache.py)
        self.keeper = None  # weak reference to the no-grad stores in use: a frozen_weights() block's or a region's
        self.region_keeps = True  # the next no-grad region keeps copies from a weight's first use (cache._Region)
        self.accumulating = None  # the accumulation() block's copies (cache.py), or None
        self.fresh = []  # grad-mode copies the call in progress made, for its output's graph to hold (cache.py)
        # engine="autocast" (hmp/core/delegation.py, which alone writes these): the Engine this thread joined,
        # whose devices' autocast state follows ``off`` (``Engine.follow``, called by enter/leave); whether hmp
        # turned it on here (the wrapper body reads it per call, so it lives on this object); what the thread
        # had before joining
        self.engine = None
        self.engine_on = False
        self.engine_found = None


if not torch_releases.BOUNDARIES["traced_state_writes"].present:
    # the floor's dynamo breaks the graph at every threading.local write and, without class
    # attributes, traced a stale ``off`` (and engine="autocast"'s ``engine_on``) after a second
    # conversion (tests/unit/core/test_compile.py)
    ThreadState.off, ThreadState.lower_mode = 0, None
    ThreadState.engine, ThreadState.engine_on = None, False

tls = ThreadState()
_KEEP = object()
_dynamo_tracing = torch.compiler.is_dynamo_compiling
_example_code, _compile_in_progress = torch_private.dynamo_example_code, torch_private.compile_in_progress
_FOUND = (0, OFF, MODULE)  # off -> itself, as a constant of the code dynamo traces


def graph_off(off):
    """Set the thread's ``off``. Called while dynamo traces, it is a node of the
    captured graph (wrapper_life.ready_for_compile), so lowering replays each change in
    order and a Python operator (``a @ b``), decided only at lowering, sees the
    state it was traced in. dynamo's own run of the node for its example value
    changes nothing."""
    if not _example_run():
        tls.off = off


def _example_run():
    """Whether dynamo runs graph_off's node for its example value (only while something compiles)."""
    if _compile_in_progress() is None:
        return False
    code, frame = _example_code(), sys._getframe(2)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame is not None


def enter(off, lower_mode=_KEEP, graph=True):
    """Set the thread's cast state where a region starts: ``off`` (0, OFF or MODULE)
    and, for a BF16 module, its mode. Returns the region's frame for ``leave()``.
    ``graph=False`` (and the same to ``leave()``): no graph_off node, for a region
    that may span a graph break (an optimizer step), whose lowering would otherwise
    leave the change in the thread."""
    st = tls
    frame = [st.off, st.lower_mode]
    if _dynamo_tracing():
        # the state found, as the value traced (guarded on), not a read of the thread that dynamo
        # replays after the graph, whose graph_off has changed it by then
        frame[0] = _FOUND[frame[0]]
    st.frames.append(frame)
    st.off = off
    if st.engine is not None:
        st.engine.follow(st, off)
    if graph and _dynamo_tracing():
        graph_off(off)
    if lower_mode is not _KEEP:
        st.lower_mode = lower_mode
    return frame


def leave(frame, graph=True):
    """End the region ``enter()`` returned ``frame`` for; a frame already left (revert()) is ignored."""
    if close_block(tls.frames, frame):
        tls.off, tls.lower_mode = frame
        if tls.engine is not None:
            tls.engine.follow(tls, frame[0])
        if graph and _dynamo_tracing():
            graph_off(frame[0])


def close_block(stack, block):
    """Take ``block`` off ``stack``, the one rule of hmp's nested blocks (cast-state
    regions, converted() blocks). True: it was innermost, the caller restores what
    it found. False: a newer block stays open and inherits what this one found (a
    generator closed inside a block it did not open). None: not on the stack."""
    if stack and stack[-1] is block:
        stack.pop()
        return True
    for i in range(len(stack) - 2, -1, -1):
        if stack[i] is block:
            stack[i + 1][:] = block
            del stack[i]
            return False
    return None


def current():
    """The calling thread's cast state ``(off, lower_mode)``, for ``switches.run_as``."""
    st = tls
    return st.off, st.lower_mode


class Runtime:
    """The current conversion and what it installed."""

    def __init__(self):
        self.lock = threading.RLock()
        self.undo_log = None  # patch.PatchLog, made by the first convert(); kept for retries of a failed undo
        self.conversion = None  # conversion.Conversion in force; None: not converted
        self.wrappers = None  # sites.Wrappers of this conversion, for register() while converted
        self.forwards = None  # modules.Forwards of this conversion: revert() makes what others captured plain
        self.handles = []  # what registering torch's global hooks returned (steps, buffers); revert() removes
        self.pickle_names = {}  # id(function) -> (function, "module:attr") (pickling.py)
        self.log_restore = None  # puts the "hmp" logger back after a verbose conversion
        self.blocks = []  # open converted() blocks, oldest first: [configuration to restore] each
        # kept across conversions
        self.registered = []  # (owner, name, kind) from hmp.register()
        self.decorated = weakref.WeakKeyDictionary()  # @hmp.*_function wrapper -> kind
        # (id(namespace), attr) -> patch.Record of an op site another library replaced after hmp's wrapper:
        # the site is that library's; the wrapper it holds follows the conversion in force (conversion.py)
        self.displaced = {}
        self.adopted = []  # the displaced records whose wrapper the conversion in force re-armed
        self.ready_for_compile = False  # wrapper_life.ready_for_compile has run in this process (conversion.apply)


runtime = Runtime()


class SharedWeakSet:
    """Objects held weakly, added by any thread while another reads or empties them.
    Each step is one dict operation, atomic under the GIL, so no lock: a
    ``weakref.WeakSet`` iterates in Python and a concurrent add makes the reader
    raise. Each object is added once."""

    __slots__ = ("_refs", "_gone")

    def __init__(self):
        refs = self._refs = {}  # id(weak reference) -> weak reference
        self._gone = lambda ref, pop=refs.pop: pop(id(ref), None)

    def add(self, obj):
        ref = weakref.ref(obj, self._gone)
        self._refs[id(ref)] = ref

    def __bool__(self):
        return bool(self._refs)

    def __len__(self):
        return len(self._refs)

    def alive(self):
        """What is alive now, in a list this thread owns."""
        return [obj for obj in (ref() for ref in list(self._refs.values())) if obj is not None]

    def take(self):
        """Empty the set and return what was alive; a racing add lands in one or the other, never lost."""
        out, pop = [], self._refs.popitem
        while True:
            try:
                obj = pop()[1]()
            except KeyError:
                return out
            if obj is not None:
                out.append(obj)


class WeightCache:
    """Lower-precision copies of weights (hmp/core/cache.py)."""

    def __init__(self):
        dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        self.grad_mode = {d: {} for d in dtypes}  # grad mode: dtype -> {id(tensor): entry}
        # what keeps copies past one call, in every thread: frozen_weights() blocks, no-grad regions, accumulation()
        self.keepers = SharedWeakSet()
        self.held = SharedWeakSet()  # what graphs hold (wrap.hold), until the next backward pass
        # engine="autocast" with cache=True in force: its Engine, whose joined threads keep torch.autocast's
        # own weight copies until hmp drops them (delegation.drop); None otherwise
        self.autocasts = None
        self.dtypes = dtypes


weight_cache = WeightCache()

warned = set()


def first_time(key):
    """True the first time ``key`` is seen in this process (warn once)."""
    if key in warned:
        return False
    warned.add(key)
    return True


def _folder(path):
    return os.path.dirname(os.path.abspath(path))


_HMP_AND_TORCH = (os.path.dirname(_folder(__file__)), _folder(torch.__file__))  # hmp/, torch/
# where a warning would point at a library's line instead of the user's: the standard library
# (contextlib's __enter__ when a library opens a region with a contextmanager) and installed packages
_LIBRARIES = tuple(
    dict.fromkeys(
        os.path.abspath(p)
        for p in (sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib"))
        if p
    )
)


def _in_folders(filename, tops):
    folder = _folder(filename)
    return any(folder == top or folder.startswith(top + os.sep) for top in tops)


def user_stacklevel():
    """``stacklevel`` for a warning raised in hmp: the first frame outside hmp, torch,
    the standard library and installed packages (the user's line), else the first
    outside hmp and torch."""
    first_library = None
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not _in_folders(name, _HMP_AND_TORCH):
            if not _in_folders(name, _LIBRARIES):
                return level
            first_library = first_library or level
        frame, level = frame.f_back, level + 1
    return first_library or level
