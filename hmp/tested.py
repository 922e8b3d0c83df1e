"""The torch releases CI tests: the floor pyproject.toml declares, README's
release and the newest one on the package index (.ci/run reads this file).
A newer torch is not refused (an upper bound in the requirements would
make pip replace a user's torch); convert() says once that it is untested."""

import re
import warnings

import torch

from hmp.core import state

TESTED_TORCH = ("2.4.1", "2.13.0", "2.15.0")


def release(version):
    """``(major, minor, patch)`` of a torch version string ("2.15.0+cu132")."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(p or 0) for p in found.groups()) if found else (0, 0, 0)


def warn_if_newer(version=torch.__version__):
    """Warn once per process when ``version`` is newer than the newest release CI tested."""
    newest = TESTED_TORCH[-1]
    if release(version) > release(newest) and state.first_time(("untested torch", version)):
        warnings.warn(
            f"hmp: torch {version} is newer than the newest release hmp was tested with ({newest}); "
            f"it will most likely work, and the test suite (python -m pytest) says for sure. "
            f"(hmp warns about this once.)",
            UserWarning,
            stacklevel=state.user_stacklevel(),
        )
