"""The one interface every rule has (as OpenTelemetry's instrumentors do):
``changes(ctx) -> Changes``, built without changing anything; the driver
(hmp/driver/conversion.py) installs what it returns through its undo log and
undoes it at revert(), every rule the same way."""

from typing import Callable, NamedTuple


class Context(NamedTuple):
    """What a rule may read while convert() builds it."""

    lists: dict  # list kind (kinds.Kind) -> op names in force
    uncast: tuple  # the conversion's uncast_calls entries
    watch: object  # hmp.binding.imports.Watch: call back when the program imports a module later
    casting: bool  # False for profile/audit's pass-through run, which casts nothing
    lower_modules: bool  # there are module entries under the lower list's rule
    # later(namespace, attr, value): a change made after convert() returned (a module imported, a
    # class created), through the same undo log; False when the conversion is gone meanwhile
    later: Callable
    # again(fn): fn, run later under the conversion in force now, installed for its call if another
    # (or none) is in force then (a checkpoint's recompute after the converted block exited)
    again: Callable = None


class Changes(NamedTuple):
    """What one rule changes in the process."""

    patches: tuple = ()  # (namespace, attr, value): set at convert(), put back at revert()
    hooks: tuple = ()  # zero-argument callables that register a torch hook and return its handle
    lacks: tuple = ()  # lines: what this torch lacks for the rule, said once; the rest still installs
