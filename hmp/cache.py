"""A version-aware cache of lower-precision copies of leaf tensors (weights).

A weight used several times in a step is cast once, and in inference the
copy survives across calls until the weight changes. An entry is used only
while everything that could make it stale is unchanged:

- the tensor's version counter (every in-place update bumps it, including
  ``optimizer.step()`` and ``with torch.no_grad(): p.copy_(...)``);
- its data pointer (``p.data = other`` and ``module.to()`` swap storage);
- the grad mode (a copy made under ``no_grad`` has no graph);
- the target dtype.

Entries are keyed by ``id()`` and dropped by a weakref callback when the
tensor dies, so the cache never keeps a weight alive through its key; it
holds at most one copy per tensor. In-place updates through ``p.data``
bypass the version counter, so the cache is also emptied whenever the
outermost ``disable_casts()`` block (where optimizer steps run) exits.
"""

import functools
import weakref

import torch

from .policy import PLAIN_CASTS

_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
_Parameter = torch.nn.Parameter


class CastCache:
    def __init__(self):
        self._entries = {}  # id(tensor) -> (version, data_ptr, grad_mode, dtype, copy, weakref)

    def __len__(self):
        return len(self._entries)

    def clear(self):
        self._entries.clear()

    def _forget(self, key, _ref):
        self._entries.pop(key, None)

    def caster(self, dtype):
        """A one-argument cast to ``dtype`` that goes through the cache for
        parameters and other leaf tensors that require grad."""
        plain = PLAIN_CASTS[dtype]
        entries, forget = self._entries, self._forget

        def cast(t):
            if type(t) is not _Parameter and not (t.requires_grad and t.is_leaf):
                return plain(t)
            if _is_compiling():  # traced tensors are fake: no data_ptr, and the graph caches for itself
                return plain(t)
            key = id(t)
            entry = entries.get(key)
            version, grad = t._version, _grad_enabled()
            if entry is not None and entry[0] == version and entry[2] is grad and entry[3] is dtype \
                    and entry[1] == t.data_ptr():
                return entry[4]
            copy = plain(t)
            ref = entry[5] if entry is not None else weakref.ref(t, functools.partial(forget, key))
            entries[key] = (version, t.data_ptr(), grad, dtype, copy, ref)
            return copy

        return cast

    def casters(self):
        return {dtype: self.caster(dtype) for dtype in PLAIN_CASTS}


cache = CastCache()


def clear_cache():
    """Drop every cached lower-precision copy."""
    cache.clear()
