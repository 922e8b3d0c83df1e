"""The loss in what a step returns, alike for audit, tune and profile."""

import numbers
from collections.abc import Mapping

import torch

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
