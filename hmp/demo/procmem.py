"""This process's peak resident memory, for the demo and the benchmarks.

On Linux the kernel's own high-water mark (VmHWM) is read from /proc and
reset through clear_refs, so a measurement starts from the memory in use
now. Unlike ``ru_maxrss`` it is not inherited from a parent through fork and
exec. Elsewhere ``ru_maxrss`` is the fallback (it cannot be reset).
"""

import sys

try:
    import resource  # Unix only
except ImportError:  # Windows
    resource = None


def _status_mib(field):
    """A ``VmRSS`` / ``VmHWM`` line of /proc/self/status in MiB, or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak():
    """Make VmHWM restart from the current RSS (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _maxrss_mib():
    if resource is None:
        return None
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024  # bytes on macOS, KiB on Linux


def start_peak():
    """Start a peak-memory measurement now. Returns ``(baseline_mib,
    read_peak, method)``: ``read_peak()`` gives the peak in MiB since this
    call (None where nothing can be measured), ``method`` says how."""
    if _status_mib("VmHWM") is not None and _reset_peak():
        method = "peak RSS (VmHWM, reset at baseline) - RSS at baseline"
        return _status_mib("VmRSS"), lambda: _status_mib("VmHWM"), method
    return _maxrss_mib(), _maxrss_mib, "ru_maxrss - ru_maxrss at baseline"
