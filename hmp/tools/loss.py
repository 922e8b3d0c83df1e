"""The loss in what a step returns, alike for audit, tune and profile; and whether
a step trains (its loss moves from one step to the next)."""

import numbers
from collections.abc import Mapping

import torch

from hmp.driver.conversion import applied

WHAT = (
    "a tensor, a number, a dict with a 'loss' entry, or an object with a .loss attribute "
    "(as Hugging Face models' outputs)"
)


def step_loss(value, tool):
    """The loss ``value`` holds, as a tensor: ``value`` itself (a tensor or a
    number), ``value["loss"]``, or ``value.loss``. Anything else is a
    TypeError saying what a step may return."""
    loss, where = value, "the step returned"
    if isinstance(value, Mapping) and "loss" in value:
        loss, where = value["loss"], "the step's value['loss'] is"
    elif not isinstance(value, (torch.Tensor, numbers.Number)) and hasattr(value, "loss"):
        loss, where = value.loss, "the step's value.loss is"
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        return torch.tensor(float(loss), dtype=torch.float64)
    shown = "None" if loss is None else f"a {type(loss).__module__}.{type(loss).__qualname__}"
    raise TypeError(f"{tool}: {where} {shown}; a step must return its loss: {WHAT}")


class StepDoesNotTrain(ValueError):
    """The step's loss does not move from one step to the next: it does not train."""


def check_trains(fn, args, kwargs, guard, steps=3):
    """Raise StepDoesNotTrain when ``steps`` fp32 steps from the guarded
    state all return the same loss: a step that only runs the forward
    (no backward, no optimizer step) gives tune nothing to compare."""
    with guard.running(), applied(None):
        losses = [float(step_loss(fn(*args, **kwargs), "hmp.tune").detach().double().mean()) for _ in range(steps)]
    if len(set(losses)) == 1:
        raise StepDoesNotTrain(
            f"hmp.tune: the step's loss did not move over {steps} steps in fp32 (each {losses[0]:.6g}), so it does "
            f"not train: tune compares training under the lists with training in fp32. The step must run "
            f"loss.backward() and optimizer.step() and return the loss."
        )
