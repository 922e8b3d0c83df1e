"""hmp: list-driven mixed precision for PyTorch on CPU, CUDA and HPU.

A drop-in for Habana's ``habana_frameworks.torch.hpex.hmp``::

    import hmp
    hmp.convert(opt_level="O1", bf16_file_path="", fp32_file_path="", isVerbose=False)
    ...
    optimizer.step()  # runs with casts off by itself while converted

Importing hmp patches nothing; only convert() does. How one call flows:
lists.py (list files) -> resolve.py (names to the places ops live) ->
policy.py (what each call casts) -> wrap.py (the wrapper) -> patch.py (the
undo log), driven by conversion.py; state.py holds everything kept.
"""

from .auditing import audit
from .cache import clear_cache, frozen_weights
from .casts import casts_enabled, disable_casts, enable_casts
from .config import convert_from_config
from .conversion import convert, converted, effective_lists, is_converted, revert
from .lists import list_path
from .profiling import profile
from .tuning import tune
from .user import bf16_function, fp32_function, promote_function, register, unregister
from .version import __version__  # noqa: F401 (hmp.__version__)
from .wrap import op_wrap, to_bf16, to_fp32

__all__ = [
    "convert",
    "revert",
    "converted",
    "disable_casts",
    "enable_casts",
    "op_wrap",
    "to_bf16",
    "to_fp32",
    "is_converted",
    "casts_enabled",
    "effective_lists",
    "list_path",
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
