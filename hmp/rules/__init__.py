"""How hmp stays out of the rest of PyTorch: one module per rule, each with
the same small interface, which ``hmp.driver.conversion`` loops over (as
OpenTelemetry's instrumentors do):

- ``patches(ctx) -> [(namespace, attr, value)]``: what the rule replaces,
  built without changing anything (convert() installs them through its undo
  log, so revert() undoes each rule with the rest);
- ``hooks(ctx) -> [handle]`` (optional): torch hooks it registers, each
  removed with ``handle.remove()`` at revert().

``ctx`` is a :class:`Context`. What each rule keeps out and why is in
docs/architecture.md; RULES is their order of installation.
"""

from typing import NamedTuple

from hmp.rules import (
    buffers,
    checkpoint,
    functions,
    region_factories,
    regions,
    rnn,
    steps,
    uncast_calls,
    weight_writes,
)


class Context(NamedTuple):
    """What a rule may read while convert() builds it."""

    lists: dict  # list kind -> op names in force ("bf16", "fp32", "promote")
    uncast: tuple  # the conversion's uncast_calls entries
    watch: object  # hmp.core.imports.Watch: call back when the program imports a module later
    casting: bool  # False for profile/audit's pass-through run, which casts nothing
    lower_modules: bool  # there are module entries under the lower list's rule


RULES = (
    rnn,  # RNN modules' own dtype check, where a kernel is listed
    checkpoint,  # recomputes run under their forward's hmp state
    functions,  # custom_fwd/custom_bwd Functions: the author's choice wins
    regions,  # autocast regions, backward, GradScaler, DataLoader workers: left alone
    steps,  # optimizer steps run uncast and drop the weight-cast cache
    weight_writes,  # lower-precision values loaded into float32 weights: said once
    uncast_calls,  # building, averaging, merging, sampling: what the program keeps, uncast
    region_factories,  # an author's autocast region however a library builds it
    buffers,  # a buffer reassigned while converted keeps its dtype
)
