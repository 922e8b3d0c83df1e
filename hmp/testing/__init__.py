"""hmp's testing kit: prove in your own CI that your lists do what you mean.

- ``expected_dtype(op, *args, **kwargs)`` / ``expected_call``: what hmp's rules
  say a call runs in, computed from the rules (hmp/testing/oracle.py);
- ``assert_runs_as(fn, *args, expect={...})`` and ``record_ops()``: what each
  op really ran in (hmp/testing/recording.py);
- ``assert_follows_rules(op, *args, **kwargs)``: one call, run under hmp,
  against the rules and plain torch (hmp/testing/follows.py);
- ``hmp.testing.strategies``: hypothesis strategies for tensors and calls
  (needs hypothesis);
- ``check_lists(...)``: ``python -m hmp check``'s API twin (needs hypothesis);
- the pytest plugin (installed with hmp, no conftest needed): the
  ``hmp_converted`` fixture and the ``@pytest.mark.hmp(...)`` marker.

``import hmp`` imports none of this; docs/testing.md shows a test file to copy.
"""

import importlib

from hmp.testing.follows import Rejected, assert_follows_rules, follow
from hmp.testing.oracle import Expected, expected_call, expected_dtype
from hmp.testing.recording import Ran, assert_runs_as, record_ops

__all__ = [
    "expected_dtype",
    "expected_call",
    "Expected",
    "assert_runs_as",
    "record_ops",
    "Ran",
    "assert_follows_rules",
    "follow",
    "Rejected",
    "check_lists",
    "strategies",
]

# what to install for the parts that draw calls (torch-hmp is not on the package index yet)
NEEDS = (
    'pip install hypothesis (or the testing extra: pip install ".[testing]" in a checkout, '
    '"torch-hmp[testing]" once published)'
)
_NEEDS_HYPOTHESIS = {"strategies": "hmp.testing.strategies", "check_lists": "hmp.testing.checking"}


def __getattr__(name):
    """``strategies`` and ``check_lists`` import hypothesis: only when asked for."""
    module = _NEEDS_HYPOTHESIS.get(name)
    if module is None:
        raise AttributeError(f"module 'hmp.testing' has no attribute {name!r}")
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != "hypothesis":
            raise
        raise ModuleNotFoundError(
            f"hmp.testing.{name} needs hypothesis: {NEEDS}",
            name="hypothesis",
        ) from e
    return loaded if name == "strategies" else getattr(loaded, name)
