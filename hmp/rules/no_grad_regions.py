"""A no-grad region keeps the weight casts it makes until it ends, as autocast's region does: the outermost
``torch.no_grad()``, ``torch.inference_mode()`` or ``set_grad_enabled(False)`` block
entered with grad on opens the cache's no-grad stores in its thread and its exit
drops them (core/cache.py's ``open_region``/``close_region``). Without it every
no-grad call would cast every weight again.

torch has no hook where a grad-mode block starts or ends, so the three classes'
``__enter__``/``__exit__`` are replaced (torch's run unchanged) and the region is kept
on the block's object, so a block whose exit hmp misses lets its copies go with it.
Grad turned off by a call opens nothing; torch.compile never runs these methods.

Grad turned back on by a block inside one (``enable_grad()``, ``set_grad_enabled(True)``)
drops engine="autocast"'s copies: torch 2.4's autocast cache serves a copy it made with
grad off, which has no graph, to a training forward (its weight gets no gradient). On such a
torch the region's thread caches nothing (the cache is the process's: a thread training beside
it would be served those copies)."""

import torch
from torch.autograd import grad_mode

from hmp.core import cache, delegation, torch_private
from hmp.core.identity import stand_in, unwrap
from hmp.rules.interface import Changes

_grad_on = torch.is_grad_enabled
_compiling = torch_private.compiling
_KEY = "_hmp_region"  # the region a block opened, on the block's object
_EDGE = "_hmp_edge"  # on a block that opened a region, for engine="autocast"'s copies (delegation.py)


def _opens_no_grad(block):
    return _grad_on()


def _opens_inference_mode(block):
    return getattr(block, "mode", True) and _grad_on()


def _opens_set_grad_enabled(block):  # grad already set by its __init__: what it found is ``prev``
    return getattr(block, "prev", False) and not getattr(block, "mode", True)


def _never(block):
    return False


def _turns_grad_on(block):  # enable_grad(), before its __enter__
    return not _grad_on()


def _turns_grad_on_again(block):  # set_grad_enabled(True): grad already set by its __init__
    return not getattr(block, "prev", True) and getattr(block, "mode", False)


def _entering(original, opens, grad_on):
    def __enter__(self):
        opening = not _compiling() and opens(self)
        found = None
        if opening:
            found = delegation.region_enters()  # engine="autocast": autocast's copies, as the cache's stores below
        elif grad_on(self) and not _compiling():
            delegation.grad_turns_on()
        region = cache.open_region() if opening else None
        try:
            result = original(self)
        except BaseException:
            if region is not None:
                cache.close_region(region)
            if found is not None:
                delegation.region_exits(found)
            raise
        if opening:
            try:
                self.__dict__[_EDGE] = (found,)
            except AttributeError:  # (below)
                delegation.region_exits(found)
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
            edge = found.pop(_EDGE, None) if found else None
            if edge is not None:
                delegation.region_exits(*edge)

    return stand_in(__exit__, original)


_BLOCKS = (  # (block, whether it opens a region, whether it turns grad back on)
    (grad_mode.no_grad, _opens_no_grad, _never),
    (grad_mode.inference_mode, _opens_inference_mode, _never),
    (grad_mode.set_grad_enabled, _opens_set_grad_enabled, _turns_grad_on_again),
    (grad_mode.enable_grad, _never, _turns_grad_on),
)


def changes(ctx):
    """The rule's changes (hmp/rules/interface.py): each block's ``__enter__`` and ``__exit__``."""
    if not ctx.casting:  # profile/audit's pass-through run casts nothing: nothing to keep
        return Changes()
    patches = []
    for cls, opens, grad_on in _BLOCKS:
        patches.append((cls, "__enter__", _entering(unwrap(cls.__dict__["__enter__"]), opens, grad_on)))
        patches.append((cls, "__exit__", _exiting(unwrap(cls.__dict__["__exit__"]))))
    return Changes(tuple(patches))
