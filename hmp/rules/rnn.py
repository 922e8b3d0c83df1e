"""RNN modules under hmp: nn.RNNBase checks in Python that input and weights share a
dtype before its kernel (``torch._VF.X``, resolve.RNN_KERNELS) is reached, so for
modules whose kernel is listed this patch lets that check see the dtype the kernel
will get while casts are on; its shape checks still run."""

import torch

from hmp.core import torch_private
from hmp.core.dtypes import FLOATS
from hmp.core.identity import stand_in, unwrap
from hmp.core.state import tls
from hmp.rules.interface import Changes

# nn.RNNBase.mode -> the kernel that module calls
MODES = torch_private.RNN_MODES


def changes(ctx):
    """The rule's changes (hmp/rules/interface.py): none on a run that casts nothing."""
    return Changes(tuple(check_input_patches(ctx.lists, ctx.lower_modules)) if ctx.casting else ())


def check_input_patches(effective, lower_modules=False):
    """``[(nn.RNNBase, "check_input", replacement)]`` when a module kernel is
    in ``effective`` (list kind -> names), or when there are BF16 module
    entries (an RNN inside one computes in the lower dtype), else ``[]``."""
    listed = frozenset(mode for mode, kernel in MODES.items() if any(kernel in names for names in effective.values()))
    base = torch.nn.RNNBase
    name = torch_private.RNN_CHECK_INPUT
    original = unwrap(base.__dict__.get(name))
    if not (listed or lower_modules) or not callable(original):
        return []
    empty, meta, flat_weights = torch.empty, torch.device("meta"), torch_private.rnn_flat_weights

    def check_input(self, input, batch_sizes):
        st = tls
        if not st.off and (self.mode in listed or st.lower_mode is not None):
            weights = flat_weights(self)
            w = weights[0] if weights else None
            if w is not None and input.dtype is not w.dtype and input.dtype in FLOATS and w.dtype in FLOATS:
                # the listed kernel's wrapper (or a BF16 module's mode) gives input
                # and weights one dtype; a storage-less stand-in keeps the shape checks
                input = empty(input.shape, dtype=w.dtype, device=meta)
        return original(self, input, batch_sizes)

    return [(base, name, stand_in(check_input, original))]
