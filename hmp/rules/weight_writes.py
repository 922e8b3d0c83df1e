"""Where a value is written into the program's weights: ``load_state_dict`` given
lower-precision tensors for float32 parameters or buffers while hmp casts. It may be
a rounded update or a bf16 checkpoint; hmp cannot tell, so it says once where
(docs/never-changes.md). Only ``load_state_dict`` is watched: ``copy_`` and ``.data =``
are hot C methods (docs/leaves-alone.md)."""

import warnings

import torch

from hmp.core import dtypes
from hmp.core.delegation import drop
from hmp.core.identity import stand_in, unwrap
from hmp.core.state import OFF, first_time, runtime, tls, user_stacklevel
from hmp.rules.interface import Changes

FP32 = torch.float32


def _rounded_into_fp32(module, state_dict, low):
    """The keys of ``state_dict`` holding ``low`` tensors that land in float32 tensors of ``module``."""
    if not any(isinstance(v, torch.Tensor) and v.dtype == low for v in state_dict.values()):
        return []
    own = dict(module.named_parameters())
    own.update(module.named_buffers())
    return [
        k
        for k, v in state_dict.items()
        if isinstance(v, torch.Tensor) and v.dtype == low and k in own and own[k].dtype == FP32
    ]


def _checked(load_state_dict):
    def checked_load_state_dict(self, state_dict, *args, **kwargs):
        conversion = runtime.conversion
        if conversion is not None and tls.off != OFF and hasattr(state_dict, "items"):
            low = conversion.options.low_precision_type
            keys = _rounded_into_fp32(self, state_dict, low)
            if keys and first_time(("rounded into fp32", low)):
                name = dtypes.name(low)
                shown = ", ".join(repr(k) for k in keys[:3]) + (", ..." if len(keys) > 3 else "")
                warnings.warn(
                    f"hmp: load_state_dict() writes {name} values into float32 parameters or buffers of "
                    f"{type(self).__name__} ({shown}) while hmp casts. If your code computed them (a soft target "
                    f"update or an average through state_dict()), hmp's casts rounded them to {name} and updates "
                    f"smaller than its rounding step are lost: compute them inside `with hmp.disable_casts():` or "
                    f"name your function in an uncast calls file (docs/never-changes.md). Values read from a "
                    f"{name} checkpoint lose nothing. (hmp warns about this once.)",
                    UserWarning,
                    stacklevel=user_stacklevel(),
                )
        drop()  # engine="autocast": its copies' graphs hold the weights (assign=True may swap them)
        try:
            return load_state_dict(self, state_dict, *args, **kwargs)
        finally:
            drop()  # and the weights are written

    return stand_in(checked_load_state_dict, load_state_dict)


def changes(ctx):
    """The rule's changes (hmp/rules/interface.py): ``Module.load_state_dict`` checked."""
    checked = _checked(unwrap(torch.nn.Module.__dict__["load_state_dict"]))
    return Changes(((torch.nn.Module, "load_state_dict", checked),))
