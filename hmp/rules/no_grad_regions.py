"""A no-grad region keeps the weight casts it makes until it ends, as autocast's region does: the outermost
``torch.no_grad()``, ``torch.inference_mode()`` or ``set_grad_enabled(False)`` block
entered with grad on opens the cache's no-grad stores in its thread and its exit
drops them (core/cache.py's ``open_region``/``close_region``). Without it every
no-grad call would cast every weight again.

torch has no hook where a grad-mode block starts or ends, so the three classes'
``__enter__``/``__exit__`` are replaced (torch's run unchanged) and the region is kept
on the block's object, so a block whose exit hmp misses lets its copies go with it.
Grad turned off by a call opens nothing; torch.compile never runs these methods."""

import torch
from torch.autograd import grad_mode

from hmp.core import cache, delegation, torch_private
from hmp.core.identity import stand_in, unwrap
from hmp.rules.interface import Changes

_grad_on = torch.is_grad_enabled
_compiling = torch_private.compiling
_KEY = "_hmp_region"  # the region a block opened, on the block's object


def _opens_no_grad(block):
    return _grad_on()


def _opens_inference_mode(block):
    return getattr(block, "mode", True) and _grad_on()


def _opens_set_grad_enabled(block):  # grad already set by its __init__: what it found is ``prev``
    return getattr(block, "prev", False) and not getattr(block, "mode", True)


def _entering(original, opens):
    def __enter__(self):
        opening = not _compiling() and opens(self)
        if opening:
            delegation.region_edge()  # engine="autocast": autocast's copies, as the cache's stores below
        region = cache.open_region() if opening else None
        try:
            result = original(self)
        except BaseException:
            if region is not None:
                cache.close_region(region)
            raise
        if region is not None:
            try:
                self.__dict__[_KEY] = region
            except AttributeError:  # an object without a __dict__ (a subclass with slots): no region
                cache.close_region(region)
        return result

    return stand_in(__enter__, original)


def _exiting(original):
    def __exit__(self, *exc):
        try:
            return original(self, *exc)
        finally:
            found = getattr(self, "__dict__", None)
            region = found.pop(_KEY, None) if found else None
            if region is not None:
                cache.close_region(region)
                delegation.region_edge()

    return stand_in(__exit__, original)


_BLOCKS = (
    (grad_mode.no_grad, _opens_no_grad),
    (grad_mode.inference_mode, _opens_inference_mode),
    (grad_mode.set_grad_enabled, _opens_set_grad_enabled),
)


def changes(ctx):
    """The rule's changes (hmp/rules/interface.py): each block's ``__enter__`` and ``__exit__``."""
    if not ctx.casting:  # profile/audit's pass-through run casts nothing: nothing to keep
        return Changes()
    patches = []
    for cls, opens in _BLOCKS:
        patches.append((cls, "__enter__", _entering(unwrap(cls.__dict__["__enter__"]), opens)))
        patches.append((cls, "__exit__", _exiting(unwrap(cls.__dict__["__exit__"]))))
    return Changes(tuple(patches))
