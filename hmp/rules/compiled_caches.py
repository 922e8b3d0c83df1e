"""torch.compile's caches that cannot key on hmp's state: off while converted.

AOTAutograd's cache (torch 2.5 on, in memory and on disk) keys a compiled
graph by the graph dynamo captured. There a Python operator (``x @ w``) is
recorded as torch's, and hmp decides it only when AOTAutograd traces it;
the key holds autocast's state but not hmp's, so the graph of a program
compiled without hmp (earlier in the process, or in an earlier process) was
served to the same program converted, in float32, and the converse. While
converted, torch's own switch turns that cache off (and back at revert(),
unless the program changed it meanwhile). Inductor's FX graph cache stays
on: it keys the graph after AOTAutograd, hmp's casts included, so it
serves compiled kernels across processes as before.
"""

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
