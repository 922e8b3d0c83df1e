"""Gradient checkpointing recomputes under the hmp state of its forward.

torch saves autocast's state at the forward and re-enters it around the rerun; hmp's
cast state (``state.current()``) must travel the same way, or the rerun computes in
other dtypes. The user's function is wrapped where torch's checkpoint takes it at call
time (Hugging Face holds the public ``checkpoint`` name): ``CheckpointFunction.forward``
(``use_reentrant=True``) and the generator ``checkpoint()`` uses on this torch
(``torch_private.checkpoint_generator``). The forward's state is set innermost, inside
torch's autocast regions, and its conversion travels too: a backward after the block
exited reruns under it, installed for the rerun alone (``ctx.again``)."""

from hmp.core import state, torch_private
from hmp.core.identity import stand_in, unwrap
from hmp.core.switches import run_as
from hmp.rules.interface import Changes


def _patches(ctx):
    """``[(namespace, attr, replacement)]`` for the checkpoint entry points this
    torch has; built without changing anything."""
    out = []
    torch_checkpoint = torch_private.CHECKPOINT_MODULE
    name = torch_private.checkpoint_generator()
    generator = unwrap(torch_checkpoint.__dict__.get(name)) if name else None
    if callable(generator):

        def without_reentrant(fn, *args, **kwargs):
            return generator(ctx.again(run_as(fn, state.current())), *args, **kwargs)

        out.append((torch_checkpoint, name, stand_in(without_reentrant, generator)))
    function = torch_private.checkpoint_function()
    forward = function.__dict__.get("forward") if function is not None else None
    if isinstance(forward, staticmethod):
        original = unwrap(forward.__func__)

        def reentrant_forward(function_ctx, run_function, preserve_rng_state, *args):
            rerun = ctx.again(run_as(run_function, state.current()))
            return original(function_ctx, rerun, preserve_rng_state, *args)

        out.append((function, "forward", staticmethod(stand_in(reentrant_forward, original))))
    return out


def changes(ctx):
    """The rule's changes (hmp/rules/interface.py)."""
    return Changes(tuple(_patches(ctx)), lacks=tuple(torch_private.checkpoint_lacks()))
