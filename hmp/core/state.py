"""Everything hmp keeps between calls, in one place; imports nothing from hmp
but torch_private and torch_releases (leaves too).

- ``tls``: per thread. ``off`` is the only thing the per-call wrapper
  reads: ``OFF`` inside ``disable_casts()``, inside a listed op (so ops it
  calls are not cast again: the outermost op decides), in backward and in
  the other regions hmp leaves alone; ``MODULE`` inside an FP32 module
  (a BF16 module inside it casts again); 0 where hmp casts. Every writer
  follows one rule, ``enter()`` where its region starts and ``leave()``
  with what enter returned where it ends, on every exit path.
- ``runtime``: the process-wide conversion. Only hmp/driver/conversion.py writes
  it, under ``runtime.lock``.
- ``weight_cache``: the weight-cast cache's stores (hmp/core/cache.py writes them).
- ``warned``: keys of the warn-once messages already given.

Kept elsewhere, on purpose: memos of what torch or a shipped file says, registrations
made at import by a floor above, weak sets of what was already looked at. Each says why
with a ``# kept: ...`` line where it is defined (tests/unit/test_one_home.py finds every
module-level store and memo and reads that line).
"""

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
MODULE = 2  # casts off for an FP32 module's forward (modules.py): a BF16 module inside turns them on


class ThreadState(threading.local):
    # Every attribute is set per thread, none on the class: dynamo before torch 2.12 reads an
    # attribute of a threading.local statically, finds a class attribute before the thread's
    # own value, and traces a stale one while its guard reads the live one (a compiled model
    # inside disable_casts() recompiled and still cast; torch_releases.BOUNDARIES, below).
    def __init__(self):
        # Each thread starts with casting on, except one first seen inside a backward pass: an
        # autograd device thread (CUDA runs backward there), which only ever runs backward, where
        # hmp casts nothing. Runs once per thread.
        self.off = OFF if _graph_task_id is not None and _graph_task_id() != -1 else 0
        self.lower_mode = None
        self.frames = []  # open regions' frames (enter/leave), oldest first
        self.autocast_regions = []  # [(id(autocast region), what enter() returned)] entered under hmp (regions.py)
        self.steps = []  # per step in progress: (what enter() returned, the frame calling its hooks) (steps.py)
        self.frozen_depth = 0  # frozen_weights() nesting (cache.py)
        self.keeper = None  # weak reference to the no-grad stores in use: a frozen_weights() block's or a region's
        self.accumulating = None  # the accumulation() block's copies (cache.py), or None
        self.fresh = []  # grad-mode copies the call in progress made, for its output's graph to hold (cache.py)
        # the last activation (no graph) cast in eager code: (weak reference, dtype, version, data pointer, copy),
        # served to the next listed op given the same unchanged tensor (q, k, v projections; cache.py)
        self.shared = None
        # engine="autocast" (hmp/core/delegation.py): the Engine this thread joined, whose devices' autocast
        # state follows ``off`` (``follow``); whether hmp turned it on here; what the thread had before joining
        self.engine = None
        self.engine_on = False
        self.engine_found = None


if not torch_releases.BOUNDARIES["traced_state_writes"].present:
    # The floor's dynamo breaks the graph at every write to a threading.local; with the class
    # attributes it runs hmp's wrappers as CI tested them there, while without them it traced a
    # stale ``off`` after a second conversion in one process (torch 2.4.1, tests/unit/test_compile.py)
    ThreadState.off, ThreadState.lower_mode = 0, None

tls = ThreadState()
_KEEP = object()
_dynamo_tracing = torch.compiler.is_dynamo_compiling
_example_code, _compile_in_progress = torch_private.dynamo_example_code, torch_private.compile_in_progress
_FOUND = (0, OFF, MODULE)  # off -> itself, as a constant of the code dynamo traces
_set_autocast = torch.set_autocast_enabled


def graph_off(off):
    """Set the thread's ``off``: called where hmp's cast state changes while
    torch.compile's dynamo traces, it is recorded in the captured graph (a
    node of its own: wrap.ready_for_compile registers it), so the lowering of
    that graph replays each change in program order. A Python operator
    (``a @ b``), which dynamo records as Python's operator and hmp decides only
    at lowering, is then decided in the state it was traced in: inside an
    FP32 module, ``disable_casts()`` or an ``@hmp.fp32_function`` too.
    dynamo itself runs the node once while it traces, for its example value:
    that run changes nothing (its trace keeps the state it traced, and a
    trace restarted after a graph break must read the thread as it was)."""
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
    """Set the calling thread's cast state where a region starts: ``off``
    (0, OFF or MODULE) and, for a BF16 module, its mode. Returns the
    region's frame (the state it found), for ``leave()`` where it ends.
    (The per-call wrappers inline the pair: they run only where ``off`` is
    0, and nothing they call outlives them.) ``graph=False`` (with the
    same to ``leave()``): no graph_off node while dynamo traces, for a region
    that may span a graph break (an optimizer step: torch.optim breaks the
    graph inside every step). The lowering of a graph that holds its start
    but not its end would leave the change in the thread, where dynamo's
    guards then read it; dynamo replays the region's writes of the thread
    after each run of the graph, and code traced after them reads them."""
    st = tls
    frame = [st.off, st.lower_mode]
    if _dynamo_tracing():
        # the state found, as the value traced (guarded on), not a read of the thread that dynamo
        # replays after the graph, whose graph_off has changed it by then
        frame[0] = _FOUND[frame[0]]
    st.frames.append(frame)
    st.off = off
    if st.engine is not None:
        follow(st, off)
    if graph and _dynamo_tracing():
        graph_off(off)
    if lower_mode is not _KEEP:
        st.lower_mode = lower_mode
    return frame


def leave(frame, graph=True):
    """End the region ``enter()`` returned ``frame`` for (``close_block``'s
    rule). A frame already left (by revert()'s unwinding) is ignored."""
    if close_block(tls.frames, frame):
        tls.off, tls.lower_mode = frame
        if tls.engine is not None:
            follow(tls, frame[0])
        if graph and _dynamo_tracing():
            graph_off(frame[0])


def follow(st, off):
    """A joined thread's autocast state after its ``off`` changed: on exactly
    where hmp casts (engine="autocast", hmp/core/delegation.py). A thread
    whose engine is no longer in force (revert()) gets its own state back."""
    engine = st.engine
    if not engine.in_force:
        engine.depart(st)
    elif (off == 0) is not st.engine_on:
        st.engine_on = on = off == 0
        for device in engine.devices:
            _set_autocast(device, on)


def close_block(stack, block):
    """Take ``block`` (a list of what it found when it opened) off ``stack``
    (oldest first), the one rule of hmp's nested blocks: thread cast-state
    regions and converted() blocks. True: it was the innermost, and the
    caller puts back what it found. False: a newer block is open (a
    generator closed inside a block it did not open); it stays in force and
    now holds what this one found, to put back when it closes. None: not on
    the stack."""
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
        self.ready_for_compile = False  # wrap.ready_for_compile has run in this process (conversion.apply)


runtime = Runtime()


class SharedWeakSet:
    """A set of objects, held weakly, that every thread adds to while any
    thread reads or empties it. Each step is one dict operation, atomic
    under the GIL (and per object in free-threaded builds), so no lock is
    taken: a ``weakref.WeakSet`` iterates in Python, and another thread's
    add raises "Set changed size during iteration" in the reader. Each
    object is added once (no de-duplication: every caller adds a new one)."""

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
        """Empty the set and return what was alive in it; an add racing with
        this lands either in what is returned or in the set, never lost."""
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
    """``stacklevel`` for a warning raised inside hmp: the first frame
    outside hmp, torch, the standard library and installed packages, so the
    warning shows the user's line (a Trainer's caller, not contextlib); the
    first frame outside hmp and torch when every frame is a library's."""
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
