"""An author's autocast region however a library spells it.

Some libraries enter an autocast region only when autocast is on (transformers 5's
``maybe_autocast``), so under hmp alone the author's float32 region would be a
``nullcontext``. The functions are data (``op_lists/autocast_factories.txt``); while
converted ``torch.is_autocast_enabled`` answers True to exactly those, in a thread
where hmp casts, so they build the real region, which hmp honours (regions.py)."""

import functools
import sys

import torch

from hmp.binding import list_files
from hmp.binding.uncast_list import entries
from hmp.binding.wrapper_life import script_as
from hmp.core.identity import stand_in, unwrap
from hmp.core.state import runtime, tls
from hmp.rules.interface import Changes
from hmp.rules.uncast_calls import place_of

FILE = "autocast_factories.txt"
_is_compiling = torch.compiler.is_compiling


# kept: a memo of what torch or a shipped file says, the same for every call, never written by one
@functools.lru_cache(maxsize=None)
def load():
    """The factories' entries, from the shipped file."""
    default = list_files.default_path(FILE)
    return entries(default, default)


def changes(ctx):
    """The rule's changes (hmp/rules/interface.py); ``ctx.watch`` takes in the
    factories of modules the program imports later."""
    factories = Factories(load())
    factories.on_import(ctx.watch)
    return Changes(tuple(factories.patches()))


class Factories:
    """The factory functions of one conversion, by code object."""

    def __init__(self, entries):
        self.entries = tuple(entries)
        self.codes = set()
        self.resolve()

    def resolve(self, module=None):
        """Take in the code of every entry resolvable now (``module``: the
        one just imported, as imports.Watch calls back; all are looked at)."""
        for entry in self.entries:
            found = place_of(entry)
            if found is not None and found[0] is None:  # a function
                code = getattr(getattr(found[1], found[2], None), "__code__", None)
                if code is not None:
                    self.codes.add(code)

    def on_import(self, watch):
        for module in sorted({e.module for e in self.entries}):
            if module not in sys.modules:
                watch.add(module, self.resolve)

    def patches(self):
        """``[(torch, "is_autocast_enabled", answer)]``: True for a factory's
        question in a thread where hmp casts, torch's answer otherwise."""
        original = unwrap(torch.is_autocast_enabled)
        codes = self.codes

        def is_autocast_enabled(*args, **kwargs):
            if (
                not _is_compiling()
                and tls.off == 0
                and runtime.conversion is not None
                and sys._getframe(1).f_code in codes
            ):
                return True
            return original(*args, **kwargs)

        stand_in(is_autocast_enabled, original)
        script_as(is_autocast_enabled, original)  # TorchScript compiles torch's (nn.TransformerEncoderLayer asks)
        return [(torch, "is_autocast_enabled", is_autocast_enabled)]
