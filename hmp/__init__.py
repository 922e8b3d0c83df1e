"""hmp: list-driven mixed precision for PyTorch on CPU, CUDA and HPU.

A drop-in for Habana's ``habana_frameworks.torch.hpex.hmp``::

    import hmp
    hmp.convert(opt_level="O1", bf16_file_path="", fp32_file_path="", isVerbose=False)
    ...
    optimizer.step()  # runs with casts off by itself while converted

Importing hmp patches nothing; only convert() does. A conversion: plan
(hmp/driver/) -> what the lists say and what each site's wrapper does
(hmp/binding/) -> conversion, through the undo log -> rules (hmp/rules/,
which keep hmp out of the rest of PyTorch). A call: wrap -> policy ->
cache -> cast_copies, with state beside (hmp/core/).
docs/architecture.md maps the rest.
"""

from hmp.binding.list_files import list_path
from hmp.binding.sites import op_wrap
from hmp.core.cache import accumulation, cache_bytes, clear_cache, frozen_weights
from hmp.core.switches import casts_enabled, disable_casts, enable_casts
from hmp.core.user_casts import to_bf16, to_fp32
from hmp.driver.conversion import convert, converted, revert
from hmp.driver.queries import effective_lists, is_converted
from hmp.driver.user import bf16_function, fp32_function, promote_function, register, unregister
from hmp.integrations.gaudi_config import convert_from_config
from hmp.tools.auditing import audit
from hmp.tools.profiling import profile
from hmp.tools.tuning import tune
from hmp.version import __version__  # noqa: F401 (hmp.__version__)

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
    "cache_bytes",
    "frozen_weights",
    "accumulation",
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
