"""The torch releases CI tests: the floor pyproject.toml declares, the
release CUDA images ship, README's release and the newest one on the
package index (.ci/run reads this file).
A newer torch is not refused (an upper bound in the requirements would
make pip replace a user's torch); convert() says once that it is untested."""

import warnings

import torch

from hmp.core import state, torch_releases
from hmp.core.torch_releases import release

TESTED_TORCH = ("2.4.1", "2.11.0", "2.13.0", "2.15.0")


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


def warn_if_lacking():
    """Warn once per process for each promise this torch cannot keep (torch_releases.release_lacks)."""
    for line in torch_releases.release_lacks():
        if state.first_time(("torch lacks", line)):
            warnings.warn(
                f"{line}. See docs/torch-releases.md. (hmp warns about this once.)",
                UserWarning,
                stacklevel=state.user_stacklevel(),
            )
