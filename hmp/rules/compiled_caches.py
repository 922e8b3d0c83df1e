"""torch.compile's caches that cannot key on hmp's state: off while converted.

AOTAutograd's cache keys a graph by what dynamo captured, where ``x @ w`` is still
torch's and hmp decides it later, so its key lacks hmp's state. torch's own switch
turns it off while converted (and back at revert(), unless the program changed it).
Inductor's FX graph cache keys the graph after hmp's casts and stays on."""

from hmp.core import torch_private
from hmp.rules.interface import Changes


class _Off:
    """A switch turned off until ``remove()`` (a hook handle's interface)."""

    def __init__(self, config, name):
        self.config, self.name = config, name
        self.before = getattr(config, name)
        setattr(config, name, False)

    def remove(self):
        if getattr(self.config, self.name) is False:  # the program's own change since stays
            setattr(self.config, self.name, self.before)


def changes(ctx):
    """The rule's changes (hmp/rules/interface.py): AOTAutograd's cache off while converted."""
    switch = torch_private.autograd_cache_switch()
    return Changes(hooks=(lambda: _Off(*switch),) if switch is not None else ())
