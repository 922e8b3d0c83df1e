"""A buffer keeps its dtype: a float32 (or float64) buffer reassigned while converted
is stored in that dtype again.

A running statistic updated out of place in ``forward`` is computed by listed ops in
bfloat16; stored as is, the buffer would change dtype in every checkpoint. torch's
global buffer registration hook casts it back and warns once per buffer
(docs/never-changes.md). ``module.to()``, ``.half()`` and ``load_state_dict`` do not
pass here."""

import warnings

import torch
from torch.nn.modules.module import register_module_buffer_registration_hook

from hmp.core import dtypes, state
from hmp.rules.interface import Changes

_KEPT = (torch.float32, torch.float64)


def _keep_dtype(module, name, value):
    if not isinstance(value, torch.Tensor) or value.dtype not in dtypes.LOW:
        return None
    try:
        old = getattr(module, name)
    except AttributeError:  # a new buffer: its dtype is the author's choice
        return None
    if not isinstance(old, torch.Tensor) or old.dtype not in _KEPT:
        return None
    if state.first_time(("buffer kept its dtype", type(module), name)):
        low, kept = (dtypes.name(d) for d in (value.dtype, old.dtype))
        warnings.warn(
            f"hmp: buffer '{name}' of {type(module).__qualname__} was assigned a {low} value while "
            f"converted; it is stored as {kept} again (buffers keep their dtype), but the value was "
            f"computed in {low}. Update it in place (self.{name}.mul_(m).add_(x, alpha=1 - m)) or inside "
            f"hmp.disable_casts() to compute it in {kept}. (hmp warns once per buffer.)",
            UserWarning,
            stacklevel=state.user_stacklevel(),
        )
    return value.to(old.dtype)


def changes(ctx):
    """The rule's changes (hmp/rules/interface.py): one module hook, no patch."""
    return Changes(hooks=(lambda: register_module_buffer_registration_hook(_keep_dtype),))
