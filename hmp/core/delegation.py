"""engine="autocast" at call time: torch's autocast casts the ops where it gives what hmp's
rule gives for every mix of input dtypes, with no Python per call (docs/engines.md; which ops:
hmp/binding/engine.py).

A joined thread has autocast on for the engine's devices exactly where hmp casts
(``tls.off == 0``): ``state.enter``/``leave`` keep it so (``state.follow``), and so does
the wrapper body where it inlines them (``pause``/``resume``, core/wrap.py), so every rule
that turns hmp's casts off turns autocast off too. Autocast's weight cache stays off: it
never checks a tensor's version. ``off_around(op)`` runs ``op`` with autocast off, for
sites of ops the lists leave to torch that autocast would act on. In a user's own
torch.autocast region ``engine_on`` is False, so the region stays theirs."""

import ctypes
import threading

import torch

from hmp.core.identity import stand_in
from hmp.core.state import follow, tls

_set_enabled, _is_enabled = torch.set_autocast_enabled, torch.is_autocast_enabled
_set_dtype, _get_dtype = torch.set_autocast_dtype, torch.get_autocast_dtype
_set_cache, _is_cache = torch.set_autocast_cache_enabled, torch.is_autocast_cache_enabled
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
        self.joined = set()  # threading.get_ident() of the threads joined now

    def join(self, st):
        """Program the calling thread (``st``: its ``tls``); what it had is kept for ``depart``."""
        if st.engine is self:
            return
        if st.engine is not None:
            st.engine.depart(st)
        st.engine_found = ([(d, _is_enabled(d), _get_dtype(d)) for d in self.devices], _is_cache())
        for device in self.devices:
            _set_dtype(device, self.dtype)
        _set_cache(False)
        st.engine, st.engine_on = self, None  # None: follow() sets the state whatever it is
        self.joined.add(threading.get_ident())
        follow(st, st.off)

    def depart(self, st):
        """The calling thread's autocast state as before it joined."""
        if st.engine is not self:
            return
        found, cache = st.engine_found
        for device, on, dtype in found:
            _set_enabled(device, on)
            _set_dtype(device, dtype)
        _set_cache(cache)
        st.engine, st.engine_on, st.engine_found = None, False, None
        self.joined.discard(threading.get_ident())

    def leave_main_thread(self):
        """Out of force (revert() in another thread): the main thread, if joined, departs at its
        next bytecode, before any op of its next line runs. Autocast's state is the thread's own
        and no other thread can write it; Python runs a pending call in the main thread only, so
        any other thread departs at its next switch of hmp's (docs/engines.md)."""
        main = threading.main_thread().ident
        if main in self.joined and threading.get_ident() != main:
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
        return start(self)

    return stand_in(_bootstrap_inner, start)
