"""A tensor written while its version counter is kept: the weight-cast cache
forgets its copies.

The cache trusts a copy while the source's version counter, data pointer and
requires_grad are unchanged (hmp/core/cache.py). torch has one way to write a
tensor and keep its counter: it puts the counter back afterwards
(``torch._C._autograd._unsafe_set_version_counter``, which
``torch.autograd._unsafe_preserve_version_counter`` calls when its block
ends). FSDP2 uses it to refill an unsharded parameter in place at every
all-gather (the same tensor, the same version, often the same address), DDP
to broadcast buffers, AOTAutograd for inputs a compiled graph mutates. While
converted, that function empties the cache before putting the counter back,
so no copy made before the write is served after it. It is looked up by name
at each call, so every caller, whenever imported, goes through it; dynamo
traces the function itself (the cache steps aside while compiling).
"""

from hmp.core import cache, torch_private
from hmp.core.identity import stand_in, unwrap
from hmp.rules.interface import Changes

_compiling = torch_private.compiling


def _forgetting(reset):
    def unsafe_set_version_counter(*args, **kwargs):
        if not _compiling():  # traced: the compiled program puts the counter back, not this call
            cache.refilled()
        return reset(*args, **kwargs)

    return stand_in(unsafe_set_version_counter, reset)


def changes(ctx):
    """The rule's changes (hmp/rules/interface.py): torch's version counter reset empties the cache first."""
    namespace, attr = torch_private.VERSION_COUNTER_RESET
    return Changes(((namespace, attr, _forgetting(unwrap(getattr(namespace, attr)))),))
