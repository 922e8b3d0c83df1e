"""The floating dtypes hmp casts between, and how messages name them: each
defined once, so every rule means the same set by "lower precision"."""

import torch

FP16, BF16, FP32, FP64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
LOW = (BF16, FP16)  # the lower-precision dtypes hmp casts down to
FLOATS = frozenset((FP16, BF16, FP32, FP64))
# every floating dtype but the key: what a cast *to* the key converts
OTHER_FLOATS = {d: FLOATS - {d} for d in FLOATS}
FP32_ONLY = frozenset((FP32,))
HALVES = frozenset(LOW)


def name(dtype):
    """``torch.bfloat16`` -> ``"bfloat16"``: a dtype as messages and reports write it."""
    return str(dtype).replace("torch.", "")


def first_floating(result):
    """The dtype of the first floating tensor in ``result`` (a tensor, or lists and tuples of them), or None."""
    if isinstance(result, torch.Tensor):
        return result.dtype if result.dtype in FLOATS else None
    if isinstance(result, (list, tuple)):
        for r in result:
            d = first_floating(r)
            if d is not None:
                return d
    return None
