"""The weight-cast cache: lower-precision copies of weights that cannot go stale.

A copy outlives its call only where hmp sees every write to its source, as in
torch.autocast: a leaf that requires grad, whose writes move autograd's version
counter. A frozen weight (peft's merge, offloading and loaders write it through
``.data``) is cast per call, except inside ``frozen_weights()``.

- Grad mode: the cache holds a copy weakly; the output's graph holds it (wrap.hold)
  until a backward pass starts (``release``), so a weight used several times in one
  forward is cast once.
- No grad: copies are kept per thread, from a weight's first use (as torch.autocast's
  region keeps its casts), for the outermost no-grad region entered with grad on or a
  ``frozen_weights()`` block, and dropped when it exits.
- An optimizer step, a refill that puts a version counter back and ``clear_cache()``
  drop every copy.

An entry is checked at each hit against the source's version counter, data pointer
and layout (shape and strides: ``p.data = p.data.t()`` moves neither), and holds the
source's storage weakly, so it goes with that storage and nothing of hmp's sits on
the user's tensor. The cache steps aside for inference tensors, functorch transforms,
``torch.jit.trace`` and compiling."""

from __future__ import annotations

import contextlib
import weakref
from functools import partial as _partial
from typing import Iterator

import torch

from hmp.core import saturating_cast, torch_private
from hmp.core.cast_copies import FINITE_CASTS, Cast, shielded
from hmp.core.delegation import drop as _drop_autocasts
from hmp.core.state import tls, weight_cache

_grad_enabled = torch.is_grad_enabled
_compiling = torch_private.compiling  # dynamo traces or the compile session runs (not torch.compiler.is_compiling)
_tracing_state = torch_private.tracing_state
_transforms_active, _forward_ad_level = torch_private.functorch_transforms_active, torch_private.forward_ad_level
_version = torch_private.version_of
_Parameter = torch.nn.Parameter
_Fake = torch_private.FakeTensor
Tensor, _ref = torch.Tensor, weakref.ref
_run_finite = saturating_cast.run


class _Frozen:
    """One thread's no-grad stores for a frozen_weights() block; ``tls.keeper`` refers to them weakly.
    ``keeps``: a weight's copy is kept from its first use; ``reused``: a kept copy served a call."""

    __slots__ = ("stores", "keeps", "reused", "__weakref__")

    def __init__(self):
        self.stores = {d: {} for d in weight_cache.dtypes}
        self.keeps, self.reused = True, False

    def clear(self):
        for store in self.stores.values():
            store.clear()


class _Region(_Frozen):
    """A no-grad region's stores, owned by torch's context manager object (a region whose
    exit hmp misses lets them go with it); emptied when a backward pass starts.

    A kept copy must pay: a region of one forward (an evaluation step, a served request)
    uses each weight once, and keeping every copy to its exit costs the allocator fresh memory
    for each (its pages given back at the exit and faulted in again at the next region), where
    a cast per call reuses one buffer. So a region keeps copies from a weight's first use where
    the thread's last region that cast a weight used a kept copy again (``tls.region_keeps``:
    ``generate()``, a loop inside one block); otherwise it casts per call until a weight comes
    back (``seen``), and keeps from then on."""

    __slots__ = ("seen",)

    def __init__(self, keeps):
        super().__init__()
        self.keeps, self.seen = keeps, set()

    def first_use(self, store, t, copy):
        """A weight cast while the region keeps nothing yet: its second use shows the region loops."""
        key = id(t)
        if key in self.seen:
            self.keeps = self.reused = True
            _put(store, t, copy, False)
        else:
            self.seen.add(key)

    def cast_weights(self):
        """Whether the region cast a weight (what says whether keeping pays in this thread)."""
        return self.reused or bool(self.seen) or any(self.stores.values())

    def clear(self):
        super().clear()
        self.seen = set()


class _Steps:
    """An ``accumulation()`` block's copies of trainable weights, one per weight, held
    strongly until an optimizer step, ``clear_cache()`` or the block's exit.
    ``backwards``: backward passes started in the block, for ``_same_step``."""

    __slots__ = ("copies", "backwards", "__weakref__")

    def __init__(self):
        self.copies = {}  # id(weight) -> its copy
        self.backwards = 0

    def clear(self):
        self.copies = {}


def _same_step(e, t, steps):
    """Whether an accumulation() copy still belongs to its weight's step: a boundary is
    seen where the weight's gradient was reset or replaced (``p.grad = None``), since a
    ``.data`` write moves neither version nor pointer. A gradient zeroed in place is not
    seen (docs/performance.md)."""
    g = t.grad
    seen = e.grad
    if g is None:
        return steps.backwards == e.backwards  # no backward since the cast: the same step's forwards
    if seen is None:  # cast before the step's first backward: its gradient is this step's
        e.grad = _ref(g)
        return True
    return seen() is g


class _CacheEntry:
    """A cached copy and what it was cast from: ``copy`` (a weak reference in grad mode,
    the copy itself in no-grad stores), the source's ``version``, ``ptr``, ``shape`` and ``stride``,
    and a weak reference to its ``storage``, whose death drops the entry."""

    __slots__ = ("copy", "version", "ptr", "shape", "stride", "storage", "steps", "grad", "backwards")


def _drop(store, key, ref):
    """The entry's storage died: drop it, unless a newer entry took its key. A dead
    grad-mode copy waits for its next lookup (a callback per copy would cost a frame)."""
    e = store.get(key)
    if e is not None and e.storage is ref:
        store.pop(key, None)


def _put(store, t, copy, weak):
    """Record ``copy`` of ``t`` in ``store``, unless ``t`` has nothing stable to check a later call against."""
    if isinstance(t, _Fake):  # no real storage (FakeTensorMode)
        return False
    try:
        version, ptr, stride = _version(t), t.data_ptr(), t.stride()
    except RuntimeError:  # an inference tensor (no version counter); a fake one (torch < 2.6 compiles eagerly)
        return False
    if _transforms_active():  # the copy is wrapped at the transform's level: it must not escape
        return False
    key = id(t)
    e = _CacheEntry()  # a new entry, stored in one step: a thread reading the old one never sees a mix
    # in grad mode the copy's graph holds the weight (its AccumulateGrad node) while the copy lives
    e.copy = weakref.ref(copy) if weak else copy
    e.version, e.ptr, e.shape, e.stride = version, ptr, t.shape, stride
    e.storage = weakref.ref(t.untyped_storage(), _partial(_drop, store, key))
    e.steps = None  # an accumulation() block whose step the copy belongs to (_same_step)
    store[key] = e
    return e


def size():
    """Usable entries: live grad-mode copies and this thread's kept ones."""
    n = sum(1 for s in weight_cache.grad_mode.values() for e in list(s.values()) if e.copy() is not None)
    keeper = _keeper()
    if keeper is not None:
        n += sum(1 for s in keeper.stores.values() for e in list(s.values()) if e.copy is not None)
    return n


def cache_bytes() -> int:
    """Bytes of the lower-precision weight copies hmp keeps alive now, in every thread:
    those no-grad regions and ``frozen_weights()`` blocks keep, and those graphs hold
    until their backward pass."""
    seen, n = set(), 0

    def count(c):
        nonlocal n
        if c is not None and id(c) not in seen:
            seen.add(id(c))
            n += c.nbytes

    for keeper in weight_cache.keepers.alive():
        if type(keeper) is _Steps:
            for c in list(keeper.copies.values()):
                count(c)
            continue
        for store in keeper.stores.values():
            for e in list(store.values()):
                count(e.copy)
    for held in weight_cache.held.alive():
        for c in held.copies or ():
            count(c)
    return n


def _keeper():
    """The calling thread's no-grad stores in use, or None."""
    ref = tls.keeper
    return ref() if ref is not None else None


def release() -> None:
    """A backward pass starts: let go what graphs hold and no-grad regions keep, so a weight
    written after it (a hand-written update) is cast again. A copy autograd saved lives
    as long as its graph."""
    if weight_cache.held:  # (empty after the backward pass's own release, at the step's)
        for h in weight_cache.held.take():
            h.copies = None
    if weight_cache.keepers:  # (an empty set: no list made at every backward)
        for keeper in weight_cache.keepers.alive():
            if type(keeper) is _Region:
                keeper.clear()
            elif type(keeper) is _Steps:
                keeper.backwards += 1


def clear_cache() -> None:
    """Drop every cached lower-precision copy, and every entry with it; the calling thread's
    next no-grad region keeps copies from a weight's first use again (``_Region``)."""
    release()
    refilled()
    tls.region_keeps = True


def refilled() -> None:
    """A tensor's version counter was put back (hmp/rules/refills.py): drop every copy.
    Finding which came from that memory would cost every refill (FSDP2 refills each
    forward); emptying the stores costs at most one recast per copy."""
    for store in weight_cache.grad_mode.values():
        store.clear()
    for keeper in weight_cache.keepers.alive():
        keeper.clear()  # accumulation() blocks' copies too: the optimizer step rewrote their weights
    _drop_autocasts()  # engine="autocast": autocast's copies too


def caster(dtype):
    """A cast_copies.Cast to ``dtype`` through the cache, for the tensors whose writes hmp
    sees (leaves that require grad; frozen ones inside ``frozen_weights()``). A hit is
    one dict lookup and a check of the entry; the ``eager`` form, for a wrapper's eager
    call, asks nothing per tensor."""
    finite_any, finite_eager = FINITE_CASTS[dtype]
    grad_mode = weight_cache.grad_mode[dtype]

    def eager(t):
        if not t.requires_grad:
            if type(t) is not _Parameter:
                # an activation (no graph): cast per call, as torch.autocast casts it. Nothing sees every write
                # to it (numpy and DLPack views, .data, storage), so no copy of it is kept (docs/performance.md)
                if type(t) is Tensor and not t.is_cpu and _forward_ad_level() < 0 and not _transforms_active():
                    return _run_finite(t, dtype)  # cast_copies' device path, inlined: one frame per cast
                return finite_eager(t)
            ref = tls.keeper  # a frozen parameter: kept inside frozen_weights() only
            keeper = ref() if ref is not None else None
            if keeper is None or type(keeper) is not _Frozen:
                return finite_eager(t)
        elif not t.is_leaf:
            return finite_eager(t)
        elif _grad_enabled():
            e = grad_mode.get(id(t))
            if e is not None:
                copy = e.copy()  # a hit: the weight is still what the copy was cast from (as below)
                if copy is not None and e.version == _version(t) and e.ptr == t.data_ptr() and e.shape == t.shape:
                    if e.stride == t.stride():
                        steps = e.steps
                        if steps is None or _same_step(e, t, steps):
                            return copy
            copy = finite_eager(t)
            e = _put(grad_mode, t, copy, True)
            if e:
                st = tls
                st.fresh.append(copy)  # the wrapper hands it to its output's graph (wrap.hold)
                steps = st.accumulating
                if steps is not None:  # inside accumulation(): held until the optimizer step
                    steps.copies[id(t)] = copy
                    e.steps, e.backwards = steps, steps.backwards
                    g = t.grad
                    e.grad = None if g is None else _ref(g)
            return copy
        else:
            ref = tls.keeper  # a no-grad region's or frozen_weights()'s stores
            keeper = ref() if ref is not None else None
            if keeper is None:
                return finite_eager(t)
        # the keeper's copy, checked here: a hit is this one frame. A copy is the weight's while its version,
        # data pointer and layout (shape and strides: ``p.data = p.data.t()`` moves neither) are unchanged
        store = keeper.stores[dtype]
        e = store.get(id(t))
        if e is not None:
            copy = e.copy
            if copy is not None and e.version == _version(t) and e.ptr == t.data_ptr() and e.shape == t.shape:
                if e.stride == t.stride():  # (a second line: caster stays within the house's 80 lines)
                    keeper.reused = True
                    return copy
        copy = finite_eager(t)
        if keeper.keeps:
            _put(store, t, copy, False)
        else:
            keeper.first_use(store, t, copy)
        return copy

    def cast(t):
        if _compiling() or _tracing_state() is not None:
            return finite_any(t)  # compile: fake tensors; jit.trace: a cached copy would become a constant
        # eager: inside a wrapper's call casts are off already, and the shield has nothing to do
        return eager(t) if tls.off else through(t)

    through = shielded(eager)  # a BF16 module's mode (module_rules.LowerMode) must not see the cast's own ops
    return Cast(cast, eager)


def cached_casts():
    """dtype -> cast through the cache, for every dtype hmp casts to."""
    return {dtype: caster(dtype) for dtype in FINITE_CASTS}


@contextlib.contextmanager
def frozen_weights() -> Iterator[None]:
    """A block in which the weights do not change, so no-grad casts of them are kept
    across calls (fast repeated inference); dropped on exit.

    Thread-local and nestable, like ``torch.autocast``. hmp still sees in-place ops,
    ``p.data = ...``, ``load_state_dict``, optimizer steps and refills (FSDP2's
    all-gathers); what you promise not to do is write through another tensor on the
    weight's memory (the ``p.data`` alias, ``dist.broadcast`` into a parameter, peft's
    ``merge_adapter()``). Frozen weights (requires_grad=False) are kept only here.
    Without it, no-grad casts of trainable weights are kept per outermost
    ``torch.no_grad()`` block from their first use."""
    st = tls
    if st.frozen_depth == 0:
        keeper = _Frozen()  # owned here: tls.keeper refers to it weakly
        weight_cache.keepers.add(keeper)
        found, ref = st.keeper, weakref.ref(keeper)
        st.keeper = ref
    st.frozen_depth += 1
    if st.frozen_depth == 1:
        _drop_autocasts()  # engine="autocast": the block's copies are its own
    try:
        yield
    finally:
        st.frozen_depth -= 1
        if st.frozen_depth == 0:
            keeper.clear()
            if st.keeper is ref:
                st.keeper = found
            _drop_autocasts()


@contextlib.contextmanager
def accumulation() -> Iterator[None]:
    """A block of gradient accumulation: each trainable weight is cast once per optimizer
    step, not once per micro-batch (torch.autocast casts it in every forward). Its copy
    is kept until the next optimizer step, ``clear_cache()`` or the block's exit: one
    lower-precision copy of every trainable weight, held across micro-batches.

    Each use is still checked against the weight's version counter and data pointer,
    and a gradient reset (``p.grad = None``, ``zero_grad()``) marks a step boundary.
    What you promise not to do: write through another tensor on the weight's memory
    (``p.data.copy_()``, a broadcast) between micro-batches, or update through ``.data``
    in a loop that zeroes gradients in place (or call ``hmp.clear_cache()`` after).
    Thread-local; nestable (the outermost block owns the copies)."""
    st = tls
    if st.accumulating is not None:
        yield
        return
    steps = _Steps()
    weight_cache.keepers.add(steps)
    st.accumulating = steps
    _drop_autocasts()  # engine="autocast": the block's copies are its own
    try:
        yield
    finally:
        st.accumulating = None
        steps.clear()
        _drop_autocasts()


def open_region():
    """The outermost no-grad region entered with grad on starts in this thread: its stores,
    for ``close_region``; None inside frozen_weights(), whose stores serve."""
    st = tls
    if st.frozen_depth:
        return None
    keeper = _Region(st.region_keeps)
    weight_cache.keepers.add(keeper)
    found, ref = st.keeper, weakref.ref(keeper)
    st.keeper = ref
    return keeper, ref, found


def close_region(region):
    """The region ``open_region`` returned ``region`` for exits: its copies go, and whether
    they paid decides how the thread's next region keeps (``_Region``)."""
    keeper, ref, found = region
    st = tls
    if keeper.cast_weights():
        st.region_keeps = keeper.reused
    keeper.clear()
    if st.keeper is ref:
        st.keeper = found
