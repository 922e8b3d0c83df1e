"""engine="autocast" at call time: torch's autocast casts the ops where it gives what hmp's
rule gives for every mix of input dtypes, with no Python per call (docs/engines.md; which ops:
hmp/binding/engine.py).

A joined thread has autocast on for the engine's devices exactly where hmp casts
(``tls.off == 0``): ``state.enter``/``leave`` keep it so (``Engine.follow``), and so does
the wrapper body where it inlines them (``pause``/``resume``, core/wrap.py), so every rule
that turns hmp's casts off turns autocast off too. ``off_around(op)`` runs ``op`` with
autocast off, for sites of ops the lists leave to torch that autocast would act on. In a
user's own torch.autocast region ``engine_on`` is False, so the region stays theirs.

Autocast's weight cache is on in joined threads (``convert(cache=True)``). It never
checks a tensor's version, so its copies are dropped (``drop``) at every point where
hmp sees a weight may change: optimizer steps, a backward pass's start, the outermost
no-grad region's entry and exit, ``frozen_weights()``/``accumulation()`` blocks,
``clear_cache()``, refills, ``load_state_dict``, ``Module._apply``, ``swap_tensors``,
an author's autocast region in another dtype, and revert. Inside ``frozen_weights()``
regions, and inside ``accumulation()`` backward passes, keep them; where
``convert(model=...)`` names the model its float32 weights' versions, pointers and
layouts are checked there instead (``passed``). Where the installed torch caches a copy
made with grad off without its graph, grad turning back on drops them too
(``copies_keep_graphs``). The cache is one for the process (torch 2.4 to 2.15: a map
under a lock), so a drop in any thread drops every thread's (docs/engines.md)."""

import ctypes
import functools
import threading

import torch

from hmp.core import torch_private
from hmp.core.identity import stand_in
from hmp.core.state import tls, weight_cache

_set_enabled, _is_enabled = torch.set_autocast_enabled, torch.is_autocast_enabled
_set_dtype, _get_dtype = torch.set_autocast_dtype, torch.get_autocast_dtype
_set_cache, _is_cache = torch.set_autocast_cache_enabled, torch.is_autocast_cache_enabled
_clear, _version = torch.clear_autocast_cache, torch_private.version_of
_nest, _unnest = torch.autocast_increment_nesting, torch.autocast_decrement_nesting
_dynamo_tracing = torch.compiler.is_dynamo_compiling
_F32 = torch.float32
_set_grad, _linear = torch_private.set_grad_enabled, torch.ops.aten.linear.default
AROUND = "__hmp_autocast_off__"  # on an off_around function: the op it runs


class Engine:
    """The engine for some devices and a lower dtype (hmp/binding/engine.py's ``engine_for()``:
    one per pair): the op names the conversion in force leaves to autocast (kind name
    -> names) and whether one is in force (``in_force``)."""

    def __init__(self, devices, dtype):
        self.devices = tuple(devices)
        self.on = (True,) * len(self.devices)  # autocast on for each of them (pause)
        self.dtype = dtype
        self.delegated = {}
        self.in_force = False
        self.cache = False  # autocast's weight cache on in joined threads (convert's cache=)
        self.model = None  # a weak reference to convert(model=...)'s model, whose weights ``passed`` checks
        self.seen = None  # that model's weights at the last drop: {id: (version, pointer, shape, stride)}
        self.threads = set()  # the joined threads' idents, while they run (``region_enters``)

    def join(self, st):
        """Program the calling thread (``st``: its ``tls``); what it had is kept for ``depart``."""
        if st.engine is self:
            return
        if st.engine is not None:
            st.engine.depart(st)
        st.engine_found = ([(d, _is_enabled(d), _get_dtype(d)) for d in self.devices], _is_cache())
        for device in self.devices:
            _set_dtype(device, self.dtype)
        _set_cache(self.cache)
        _nest()  # as inside a torch.autocast region: a region's exit inside (enabled=False) keeps the copies
        st.engine, st.engine_on = self, None  # None: follow sets the state whatever it is
        self.threads.add(threading.get_ident())
        self.follow(st, st.off)

    def follow(self, st, off):
        """The joined thread's autocast state after its ``off`` changed (``st``: its ``tls``): on
        exactly where hmp casts; out of force, the thread gets its own back."""
        if not self.in_force:
            self.depart(st)
        elif (off == 0) is not st.engine_on:
            st.engine_on = on = off == 0
            for device in self.devices:
                _set_enabled(device, on)

    def depart(self, st):
        """The calling thread's autocast state as before it joined."""
        if st.engine is not self:
            return
        found, cache = st.engine_found
        for device, on, dtype in found:
            _set_enabled(device, on)
            _set_dtype(device, dtype)
        _set_cache(cache)
        _unnest()
        st.engine, st.engine_on, st.engine_found = None, False, None
        self.threads.discard(threading.get_ident())
        _clear()  # the copies its cache made: none outlives the conversion

    def leave_main_thread(self):
        """Out of force (revert() in another thread): the main thread, if joined, departs at its
        next bytecode, before any op of its next line runs. Autocast's state is the thread's own
        and no other thread can write it; Python runs a pending call in the main thread only, so
        any other thread departs at its next switch of hmp's (docs/engines.md)."""
        main = threading.main_thread().ident
        if main in self.threads and threading.get_ident() != main:
            in_main_thread(self._depart_main)

    def _depart_main(self):
        st = tls
        if st.engine is self and not self.in_force:
            self.depart(st)


# kept: pending calls' C callbacks and whether each has run, alive past their run (freed at the next schedule)
_pending = []
_PENDING_CALL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


def in_main_thread(fn):
    """Run ``fn()`` in the main thread at its next bytecode (CPython's Py_AddPendingCall);
    False where it cannot be scheduled."""
    add = getattr(getattr(ctypes, "pythonapi", None), "Py_AddPendingCall", None)
    if add is None:
        return False
    _pending[:] = [p for p in _pending if not p[1]]
    entry = [None, False]

    def call(_):
        try:
            fn()
        except Exception:  # a pending call must not raise into whatever the main thread runs
            pass
        entry[1] = True
        return 0

    entry[0] = _PENDING_CALL(call)
    _pending.append(entry)
    if add(entry[0], None) != 0:
        _pending.remove(entry)
        return False
    return True


def pause(st, running):
    """A joined thread's autocast off for a call hmp runs itself (core/wrap.py: its casts and its op),
    where hmp had it on; returns what to give ``resume``. In compiled or traced code (``running``) the
    state found is what comes back, not the one ``engine_on`` says: while dynamo traces, a traced switch
    has changed the state and its write of ``engine_on`` waits for the graph (dynamo runs wrappers
    for their fake values meanwhile). In eager code ``engine_on`` is the state: nothing is read."""
    engine = st.engine
    found = tuple([_is_enabled(device) for device in engine.devices]) if running else engine.on
    st.engine_on = False
    for device in engine.devices:
        _set_enabled(device, False)
    return found


def resume(st, found):
    """Undo ``pause``."""
    st.engine_on = True
    for device, on in zip(st.engine.devices, found):
        _set_enabled(device, on)


def as_torch(st, running, op, args, kwargs):
    """``op`` (a builtin) called as torch's, with a joined thread's autocast paused: a wrapper's call
    that needs no cast (an op in no list, bound for the calls that do) is one autocast must not cast."""
    found = pause(st, running)
    try:
        return op(*args, **kwargs)
    finally:
        resume(st, found)


def drop():
    """A weight may have changed where hmp sees it: autocast's copies go, in every thread. Where
    ``convert(model=...)`` names the model and this thread keeps copies past a boundary (inside
    ``frozen_weights()`` or ``accumulation()``), its weights are noted for ``passed``."""
    engine = weight_cache.autocasts
    if engine is None:
        return
    _clear()
    if _dynamo_tracing():
        return  # (a node of the graph: the compiled step clears when it runs)
    st = tls
    model = engine.model() if engine.model is not None else None
    keeps = st.frozen_depth or st.accumulating is not None
    engine.seen = _weights(model) if model is not None and keeps else None


def passed(kept):
    """A boundary where copies may stay: the outermost no-grad region's entry or exit, a backward
    pass's start. ``kept``: the thread's block keeps them past it (``frozen_weights()`` for a
    region, ``accumulation()`` for a backward). They stay only there, and where the model
    ``convert(model=...)`` names is found as it was at the last drop; else they go."""
    engine = weight_cache.autocasts
    if engine is None:
        return
    if kept:
        model = engine.model() if engine.model is not None else None
        if model is None or _weights(model) == engine.seen:
            return
    drop()


def region_enters():
    """The outermost no-grad region starts: copies are kept past it inside ``frozen_weights()``.
    Where the installed torch's copies made with grad off have no graph and other threads are
    joined, the thread's cache is off for the region (the cache is the process's: a thread
    training beside it would read them); returns what ``region_exits`` puts back (None: nothing)."""
    passed(tls.frozen_depth)
    engine = weight_cache.autocasts
    if engine is None or len(engine.threads) < 2 or copies_keep_graphs():
        return None  # (one thread: hmp sees each of its regions end, where the copies go)
    found = _is_cache()
    _set_cache(False)
    return found


def region_exits(found=None):
    """It ends, grad back on: inside ``frozen_weights()`` the copies stay, where they have graphs.
    ``found``: what ``region_enters`` returned."""
    if found is not None:
        _set_cache(found)
    if weight_cache.autocasts is not None and not (tls.frozen_depth and copies_keep_graphs()):
        drop()


def grad_turns_on():
    """``enable_grad()`` inside a no-grad region: copies made there must have graphs."""
    if weight_cache.autocasts is not None and not copies_keep_graphs():
        drop()


# kept: what the installed torch's autocast cache does, probed once
@functools.lru_cache(maxsize=None)
def copies_keep_graphs():
    """Whether a copy autocast's cache makes with grad off keeps its graph (pytorch#158232: 2.13 and
    2.15 here): torch 2.4's has none, so a training forward served it gives the weight no gradient.
    Probed with aten's op (no wrapper of hmp's) and grad set directly (no region of hmp's)."""
    w, x = torch.ones(1, 1, requires_grad=True), torch.ones(1, 1)
    found = _is_enabled("cpu"), _get_dtype("cpu"), _is_cache(), torch.is_grad_enabled()
    _set_enabled("cpu", True)
    _set_dtype("cpu", torch.bfloat16)
    _set_cache(True)
    try:
        _set_grad(False)
        _linear(x, w)
        _set_grad(True)
        return _linear(x, w).requires_grad
    finally:
        _clear()
        _set_grad(found[3])
        _set_enabled("cpu", found[0])
        _set_dtype("cpu", found[1])
        _set_cache(found[2])


def backward_starts():
    """A backward pass starts: copies are kept past it inside ``accumulation()``."""
    passed(tls.accumulating is not None)


def _weights(model):
    """What a write to ``model``'s weights that autocast caches (float32, requiring grad) moves:
    version counter, data pointer, shape and strides, by id (a weight replaced by another tensor
    is another cache key)."""
    out = {}
    for p in model.parameters():
        if p.requires_grad and p.dtype is _F32:
            try:
                out[id(p)] = (_version(p), p.data_ptr(), p.shape, p.stride())
            except RuntimeError:  # an inference tensor: no version to read
                out[id(p)] = None
    return out


def dropping(fn):
    """``fn`` (a write hmp sees: ``Module._apply``, ``swap_tensors``) with autocast's copies dropped
    before it and after it: before, as ``swap_tensors`` refuses a tensor the cache points to."""

    def dropping_copies(*args, **kwargs):
        drop()
        try:
            return fn(*args, **kwargs)
        finally:
            drop()

    return stand_in(dropping_copies, fn)


def uncached(fn):
    """``fn`` (``Module._slow_forward``, which torch.jit.trace runs) with autocast's cache off
    in a joined thread: a copy kept from before the trace would be recorded as a constant."""

    def without_copies(*args, **kwargs):
        if not tls.engine_on or not _is_cache():
            return fn(*args, **kwargs)
        _set_cache(False)
        try:
            return fn(*args, **kwargs)
        finally:
            _set_cache(True)

    return stand_in(without_copies, fn)


def off_around(op, devices):
    """``op`` run with autocast off where hmp turned it on (see the module's doc)."""
    op = getattr(op, AROUND, op)

    def autocast_off(*args, **kwargs):
        st = tls
        if not st.engine_on:
            return op(*args, **kwargs)
        # the state found, not the one ``engine_on`` says: while dynamo traces, a traced switch has
        # changed the state and its write of ``engine_on`` waits for the graph (a fake-value run)
        found = [_is_enabled(device) for device in devices]
        st.engine_on = False
        for device in devices:
            _set_enabled(device, False)
        try:
            return op(*args, **kwargs)
        finally:
            st.engine_on = True
            for device, on in zip(devices, found):
                _set_enabled(device, on)

    stand_in(autocast_off, op)
    setattr(autocast_off, AROUND, op)
    return autocast_off


def joining(start, engine):
    """``Thread._bootstrap_inner`` for a conversion: a thread started while
    converted joins ``engine``, before its target runs."""

    def _bootstrap_inner(self):
        if engine.in_force:
            engine.join(tls)
        try:
            return start(self)
        finally:
            engine.threads.discard(threading.get_ident())

    return stand_in(_bootstrap_inner, start)
