"""Habana's public helpers: ``op_wrap`` (a wrapper of any op that passes
its tensors through a cast function), ``to_bf16`` and ``to_fp32``."""

from typing import Any, Callable

import torch

from hmp.core import cast_copies
from hmp.core.rescue import About
from hmp.core.wrap import make

_to_bf16 = cast_copies.FINITE_CASTS[torch.bfloat16].any
_to_fp32 = cast_copies.ROUNDING_CASTS[torch.float32].any


def op_wrap(op: Callable, cast_fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """Habana's public helper: a wrapper of ``op`` that passes every tensor
    argument (positional, keyword, or inside a list/tuple) through
    ``cast_fn`` before calling it. It follows ``disable_casts`` and the
    outermost-op rule like every hmp wrapper, converted or not."""

    def cast_value(v):
        if isinstance(v, torch.Tensor):
            return cast_fn(v)
        if type(v) is list or type(v) is tuple:
            return type(v)(cast_value(x) for x in v)
        return v

    def prepare(args, kwargs):
        return tuple(cast_value(a) for a in args), {k: cast_value(v) for k, v in kwargs.items()}

    return make(op, prepare, About(getattr(op, "__qualname__", None) or repr(op)))


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
