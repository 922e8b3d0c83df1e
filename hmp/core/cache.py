"""The weight-cast cache: lower-precision copies of weights that cannot go stale.

Correct by construction: no copy outlives the reason it was made.

- Grad mode: a copy is held only through a weak reference, and strongly by
  the graph of the output it was made for: torch keeps a tensor's Python
  object alive while the autograd graph saves it (a weight), and the
  wrapper puts a copy autograd does not save (a bias) in that output's
  ``grad_fn.metadata`` (wrap.hold). So the copy lives as long as the graph
  that uses it, until a backward pass starts (``release``): backward, or
  dropping the output, frees it. A weight
  used several times in one forward (tied embeddings, an RNN cell, every
  micro-batch of one accumulated step) is cast once; the next step casts
  again.
- No grad: copies are kept for a region, per thread: the outermost of
  torch's own no-grad regions (``torch.no_grad()``, ``torch.inference_mode()``,
  ``torch.set_grad_enabled(False)`` as a block, entered with grad on:
  ``model.generate()``, an evaluation loop; hmp/rules/no_grad_regions.py
  tells ``open_region``/``close_region``), or ``hmp.frozen_weights()``,
  where the caller states the weights do not change. Dropped when that
  region exits; a region's also when a backward pass starts. Outside both
  (grad turned off by a call, not a block) copies are not kept.
- Every optimizer step (torch's global step post hook, see hmp/rules/steps.py)
  and ``clear_cache()`` drop every copy.

Within those lifetimes an entry (named fields, see ``_Entry``) is also
checked against what can change cheaply (version counter, data pointer,
requires_grad), and it holds the source storage so its address cannot be
reused. A write that keeps the version counter does so through torch's one
way to put a counter back, ``torch._C._autograd._unsafe_set_version_counter``
(``torch.autograd._unsafe_preserve_version_counter`` calls it): FSDP2 refills
an unsharded parameter in place with it at every all-gather (same tensor,
same version, often the same address), DDP broadcasts buffers with it.
hmp/rules/refills.py sees each call and ``refilled()`` drops every copy, so
the per-call check stays the three comparisons above. What no counter
shows at all is a write through another tensor on the same memory (the
``p.data`` alias, storage-level copies, collectives such as
``dist.broadcast``, which declare no write): invisible only while a graph
that saved the old copy is still alive (a forward's output kept across the
write, ``retain_graph=True``), or inside a no-grad region or
``frozen_weights()``. The cache steps aside for inference tensors (no
version counter), under functorch transforms (their tensors have no
storage), while ``torch.jit.trace`` runs (a cached copy would be recorded
as a constant) and while torch.compile traces (fake tensors).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch

from hmp.core import torch_private
from hmp.core.cast_copies import CASTS, eager_of, shielded
from hmp.core.state import tls, weight_cache

_grad_enabled = torch.is_grad_enabled
_compiling = torch_private.compiling  # dynamo traces or the compile session runs (not torch.compiler.is_compiling)
_tracing_state = torch_private.tracing_state
_transforms_active = torch_private.functorch_transforms_active
_version = torch_private.version_of
_Parameter = torch.nn.Parameter
_Fake = torch_private.FakeTensor


class _Frozen:
    """One thread's no-grad stores for a frozen_weights() block, registered so
    clear_cache() and refilled() reach them; the thread's ``tls.kept`` refers
    to them weakly, so they go with what owns them (the block)."""

    __slots__ = ("stores", "__weakref__")

    def __init__(self):
        self.stores = {d: {} for d in weight_cache.dtypes}

    def clear(self):
        for store in self.stores.values():
            store.clear()


class _Region(_Frozen):
    """A no-grad region's stores, owned by torch's context manager object
    (hmp/rules/no_grad_regions.py): a region whose exit hmp does not see
    (revert() inside it) lets them go with that object. Also emptied when a
    backward pass starts."""

    __slots__ = ()


class _Entry:
    """A cached copy and what it was cast from. ``copy``: a weak reference to
    the copy (grad mode) or the copy itself (frozen_weights); ``version``,
    ``ptr``, ``grad``: the source's version counter, data pointer and
    requires_grad at the cast; ``storage`` holds the source storage so its
    address cannot be reused; ``source``: a weak reference to the source
    that drops the entry with it."""

    __slots__ = ("copy", "version", "ptr", "grad", "storage", "source")


def _forget(store, key):
    return lambda _ref: store.pop(key, None)


def _keep(store, t, copy, old, weak):
    """Record ``copy`` of ``t`` in ``store`` (replacing ``old``), unless
    ``t`` has nothing stable to check a later call against."""
    if isinstance(t, _Fake):  # no real storage (FakeTensorMode)
        return False
    try:
        version, ptr = _version(t), t.data_ptr()
    except RuntimeError:  # an inference tensor (no version counter); a fake one (torch < 2.6 compiles eagerly)
        return False
    if _transforms_active():  # the copy is wrapped at the transform's level: it must not escape
        return False
    e = _Entry()  # a new entry, stored in one step: a thread reading the old one never sees a mix
    # torch keeps a tensor's Python object alive while C++ (a graph's saved
    # tensors) holds it, so the weak reference lives as long as that (2.4 to 2.14)
    e.copy = weakref.ref(copy) if weak else copy
    e.version, e.ptr, e.grad, e.storage = version, ptr, t.requires_grad, t.untyped_storage()
    key = id(t)
    e.source = old.source if old is not None else weakref.ref(t, _forget(store, key))
    store[key] = e
    return True


def size():
    """Usable entries: live grad-mode copies and this thread's frozen ones."""
    n = sum(1 for s in weight_cache.live.values() for e in list(s.values()) if e.copy() is not None)
    kept = _kept()
    return n + (sum(len(s) for s in kept.stores.values()) if kept is not None else 0)


def _kept():
    """The calling thread's no-grad stores in use, or None."""
    ref = tls.kept
    return ref() if ref is not None else None


def _dead():
    return None


def release() -> None:
    """What graphs hold for reuse (wrap.hold) is let go, and what no-grad
    regions keep: a backward pass starts (hmp/rules/regions.py), so weights
    written after it through ``p.data`` (a hand-written update) are cast
    again in an enclosing region. A copy autograd saves lives on as long as
    its graph does."""
    if weight_cache.held:  # (empty after the backward pass's own release, at the step's)
        for h in weight_cache.held.take():
            h.copies = None
    if weight_cache.frozen:  # (an empty set: no list made at every backward)
        for kept in weight_cache.frozen.live():
            if type(kept) is _Region:
                kept.clear()


def clear_cache() -> None:
    """Drop every cached lower-precision copy. A grad-mode entry stays as an
    empty one, so the weight's next cast (each training step) reuses its
    weak reference to the weight instead of making another."""
    release()
    for store in weight_cache.live.values():
        for e in list(store.values()):
            e.copy, e.storage = _dead, None
    for kept in weight_cache.frozen.live():
        kept.clear()


def refilled() -> None:
    """A tensor was written and its version counter put back (hmp/rules/refills.py):
    drop every copy. Which copies came from that memory is not worth finding
    at each refill (FSDP2 refills every module's parameters at every forward);
    each store is emptied at C speed, and what went is cast again at its next
    use, so the work is at most one drop per cast."""
    for store in weight_cache.live.values():
        store.clear()
    for frozen in weight_cache.frozen.live():
        for store in frozen.stores.values():
            store.clear()


def caster(dtype):
    """A one-argument cast to ``dtype`` that goes through the cache for
    parameters and other leaf tensors that require grad. A hit is one
    dictionary lookup and a check of the entry's named fields.
    ``cast.eager``: the same cast for a wrapper's call in eager code, which
    has turned casts off and asked once whether anything traces or compiles
    (hmp/core/wrap.py), so it asks nothing per tensor."""
    plain = CASTS[dtype]
    lowered = eager_of(plain)
    live = weight_cache.live[dtype]

    def eager(t):
        if type(t) is not _Parameter and not (t.requires_grad and t.is_leaf):
            return lowered(t)
        if _grad_enabled():
            e = live.get(id(t))
            if e is not None:
                copy = e.copy()
                if (
                    copy is not None
                    and e.version == _version(t)
                    and e.ptr == t.data_ptr()
                    and e.grad is t.requires_grad
                ):
                    return copy
            copy = lowered(t)
            if _keep(live, t, copy, e, True):
                tls.fresh.append(copy)  # the wrapper hands it to its output's graph (wrap.hold)
            return copy
        ref = tls.kept  # a no-grad region's or frozen_weights()'s stores
        kept = ref() if ref is not None else None
        if kept is None:
            return lowered(t)
        store = kept.stores[dtype]
        e = store.get(id(t))
        if e is not None and e.version == _version(t) and e.ptr == t.data_ptr():
            return e.copy
        copy = lowered(t)
        _keep(store, t, copy, e, False)
        return copy

    def cast(t):
        if type(t) is not _Parameter and not (t.requires_grad and t.is_leaf):
            return plain(t)
        if _compiling() or _tracing_state() is not None:
            return plain(t)  # compile: fake tensors; jit.trace: a cached copy would become a constant
        return through(t)

    through = shielded(eager)  # a BF16 module's mode (modules.LowerMode) must not see the cast's own ops
    cast.eager = eager
    return cast


def casters():
    """dtype -> cast through the cache, for every dtype hmp casts to."""
    return {dtype: caster(dtype) for dtype in CASTS}


@contextlib.contextmanager
def frozen_weights() -> Iterator[None]:
    """A block in which the weights do not change, so no-grad casts of them
    are kept across calls (fast repeated inference); dropped on exit.

    Thread-local and nestable, like ``torch.autocast``. hmp still sees
    in-place ops, ``p.data = ...``, ``load_state_dict``, optimizer steps and
    refills that put the version counter back (FSDP2's all-gathers) inside
    the block; what it cannot see is a write through another tensor on the
    weight's memory (the ``p.data`` alias, ``dist.broadcast`` into a
    parameter), which is what you promise not to do here. Without it,
    no-grad casts are kept for the outermost ``torch.no_grad()`` /
    ``torch.inference_mode()`` block, under the same checks, and dropped
    when it exits or a backward pass starts; the block keeps them across
    such regions (a loop that enters ``torch.no_grad()`` per batch)."""
    st = tls
    if st.frozen_depth == 0:
        kept = _Frozen()  # owned here: tls.kept refers to it weakly
        weight_cache.frozen.add(kept)
        found, ref = st.kept, weakref.ref(kept)
        st.kept = ref
    st.frozen_depth += 1
    try:
        yield
    finally:
        st.frozen_depth -= 1
        if st.frozen_depth == 0:
            kept.clear()
            if st.kept is ref:
                st.kept = found


def open_region():
    """A no-grad region starts in this thread with grad on before it (the
    outermost: hmp/rules/no_grad_regions.py): its stores, for
    ``close_region``, which the caller keeps; None inside frozen_weights(),
    whose stores serve."""
    st = tls
    if st.frozen_depth:
        return None
    kept = _Region()
    weight_cache.frozen.add(kept)
    found, ref = st.kept, weakref.ref(kept)
    st.kept = ref
    return kept, ref, found


def close_region(region):
    """The region ``open_region`` returned ``region`` for exits: its copies go."""
    kept, ref, found = region
    kept.clear()
    st = tls
    if st.kept is ref:
        st.kept = found
