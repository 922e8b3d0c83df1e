"""How hmp meets other precision machinery in the same process.

torch.autocast: hmp casts nothing inside a torch.autocast region entered
while it is converted, enabled or not (hmp/rules/regions.py, docs/leaves-alone.md).
A region entered before convert() is not one for hmp: there both act, and
since autocast casts inside the dispatcher, after hmp's Python-level casts,
autocast's lists win for ops both know. convert() warns once per process
when called inside such an active region.
"""

import warnings

import torch

from hmp.core import state

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "hpu", "mps", "xla", "ipu", "mtia", "maia", "privateuseone")


def autocast_regions():
    """The device types for which torch.autocast is enabled in this thread."""
    found, per_device = [], True
    for device in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(device):
                found.append(device)
        except TypeError:  # torch < 2.4 takes no argument
            per_device = False
            break
        except (RuntimeError, ValueError):  # a device type this torch does not know
            pass
    if not per_device:  # torch < 2.4: one function per device type
        for device, fn in (
            ("cuda", "is_autocast_enabled"),
            ("cpu", "is_autocast_cpu_enabled"),
            ("xpu", "is_autocast_xpu_enabled"),
            ("hpu", "is_autocast_hpu_enabled"),
        ):
            try:
                if getattr(torch, fn, lambda: False)():
                    found.append(device)
            except (TypeError, RuntimeError):
                pass
    return found


def warn_inside_autocast():
    """Warn (once per process) when convert() runs inside torch.autocast."""
    if "convert inside autocast" in state.warned:
        return
    st = state.tls
    ours = st.engine.devices if st.engine is not None and st.engine_on else ()  # engine="autocast" set them
    devices = [d for d in autocast_regions() if d not in ours]
    if devices:
        warnings.warn(
            f"hmp: convert() called inside an active torch.autocast region ({', '.join(devices)}). hmp casts nothing "
            f"inside autocast regions entered after convert(), but in this one, entered before, both act. autocast "
            f"casts inside the dispatcher, after hmp's Python-level casts, so for ops both know autocast's lists win: "
            f"an op in hmp's FP32 list can still run in autocast's lower precision, and one in hmp's lower-precision "
            f"list in "
            f"fp32. Leaving the autocast region does not revert hmp. Use one of the two for a region of code. "
            f"(hmp warns about this once per process.)",
            UserWarning,
            stacklevel=state.user_stacklevel(),
        )
        state.warned.add("convert inside autocast")
