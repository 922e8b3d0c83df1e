"""hmp: list-driven mixed precision for PyTorch on CPU, CUDA and HPU.

A drop-in for Habana's ``habana_frameworks.torch.hpex.hmp``::

    import hmp
    hmp.convert(opt_level="O1", bf16_file_path="", fp32_file_path="", isVerbose=False)
    ...
    optimizer.step()  # runs with casts off by itself while converted

Importing hmp patches nothing; only convert() does.
"""

from .audit import audit
from .cache import clear_cache, frozen_weights
from .config import convert_from_config
from .convert import convert, effective_lists, is_converted, revert
from .state import casts_enabled, disable_casts
from .profile import profile
from .tune import tune
from .user import bf16_function, fp32_function, promote_function, register, unregister
from .wrap import op_wrap, to_bf16, to_fp32

__version__ = "0.1.0"

__all__ = [
    "convert",
    "revert",
    "disable_casts",
    "op_wrap",
    "to_bf16",
    "to_fp32",
    "is_converted",
    "casts_enabled",
    "effective_lists",
    "clear_cache",
    "frozen_weights",
    "bf16_function",
    "fp32_function",
    "promote_function",
    "register",
    "unregister",
    "profile",
    "audit",
    "tune",
    "convert_from_config",
]
