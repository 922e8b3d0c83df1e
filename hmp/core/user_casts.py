"""Habana's public casts, called from a user's code or through ``op_wrap``
(hmp/binding/sites.py): ``to_bf16`` and ``to_fp32``."""

from typing import Any

import torch

from hmp.core import cast_copies

_to_bf16 = cast_copies.FINITE_CASTS[torch.bfloat16].any
_to_fp32 = cast_copies.ROUNDING_CASTS[torch.float32].any


def to_bf16(t: Any) -> Any:
    """Cast a float32 tensor to bfloat16; anything else is returned as is."""
    if isinstance(t, torch.Tensor) and t.dtype is torch.float32:
        return _to_bf16(t)
    return t


def to_fp32(t: Any) -> Any:
    """Cast a bfloat16/float16 tensor to float32; anything else is returned as is."""
    if isinstance(t, torch.Tensor) and (t.dtype is torch.bfloat16 or t.dtype is torch.float16):
        return _to_fp32(t)
    return t
