"""A tensor written while its version counter is kept: the weight-cast cache forgets
its copies.

torch's one way to write a tensor and keep its counter is to put the counter back
afterwards (``_unsafe_set_version_counter``), as FSDP2's all-gather, DDP's buffer
broadcast and AOTAutograd's input mutations do. While converted that function empties
the cache first, so no copy made before the write is served after it; it is looked up
by name at each call, so every caller goes through it."""

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
