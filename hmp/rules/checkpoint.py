"""Gradient checkpointing recomputes under the hmp state of its forward.

torch.utils.checkpoint reruns a function's forward during backward. torch
saves autocast's state at the forward and re-enters it around the rerun;
hmp's cast state (``state.current()``: casts on or off, and the module policy
in force) must travel the same way, or the rerun computes in other dtypes
than the forward did (CheckpointError, or wrong gradients). Both
modes are covered by wrapping the user's function where torch's checkpoint
takes it at call time, not the public ``checkpoint`` name (Hugging Face
holds a reference to that one):

- ``use_reentrant=True``: ``CheckpointFunction.forward`` stores the function
  that backward reruns;
- ``use_reentrant=False``: the generator that builds the rerun from it
  (``_checkpoint_without_reentrant_generator``; 2.14:
  ``_checkpoint_without_reentrant_generator_impl``, the old name a shim
  around it): the one ``checkpoint()`` calls on this torch, decided at
  convert time (``torch_private.checkpoint_generator``).

The wrapper sets the captured state innermost, inside the autocast regions
torch enters for the rerun: the forward's state wins over anything that
turned casts off around the backward. The conversion travels with it: a
backward run after the converted block exited (``with hmp.converted():
loss = f(x)``, then ``loss.backward()``, torch.autocast's idiom) or after
convert() reconfigured reruns under the forward's conversion, installed for
the rerun alone (``ctx.again``).
"""

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
