"""The names a list may not hold: calls that alias, copy, move or only
write data, where a cast would break the program instead of choosing a
precision. lists.py skips them with a warning (``warn_skipped``)."""

import warnings

from hmp.binding.aten import returns_view
from hmp.core import state

# Names hmp refuses in a list: calls that alias, copy, move or only write
# data. A cast there does not choose a precision, it breaks the program:
# `x[i] = v` writing a cast copy of x, `clone()` making a bf16 copy of a
# parameter, `x.float()` returning bfloat16. Views (a result that aliases an
# input, by torch's schema) and the `X_copy` forms of views are found from
# torch's schemas; these are the rest, which no schema marks.
# Tensor methods that convert to the dtype they name (modules.py's mode leaves them alone too):
DTYPE_CONVERSIONS = ("type", "type_as", "float", "double", "half", "bfloat16")
MOVES = frozenset(
    (
        "__getitem__",
        "__setitem__",
        "__delitem__",  # indexing: a view or a copy, a write
        "clone",
        "copy",
        "_to_copy",
        *DTYPE_CONVERSIONS,
        "new_tensor",
        "to_dense",
        "to_sparse",  # copies and conversions (`to`, `cpu`, `contiguous` are views by their schemas)
        "copy_",
        "fill_",
        "zero_",
        "set_",
        "resize_",
        "resize_as_",
        "detach_",
        "requires_grad_",  # writes only
    )
)
# Habana's published default lists name `t` (a view): scripts written for
# them keep working; a view is never cast, so the line binds nothing.
SEED_VIEWS = frozenset(("t",))


def refusal(op):
    """Why ``op`` may not be in a list (a phrase), or None when it may."""
    if op in SEED_VIEWS:
        return None
    if op in MOVES:
        return "copies, moves or writes data rather than computing"
    if returns_view(op):
        return "returns a view of its input (a cast copy would not be one)"
    base = op[: -len("_copy")] if op.endswith("_copy") else None
    if base and returns_view(base):
        return f"copies the view {base} returns"
    return None


def warn_skipped(where):
    """One warning for a file's names that are no precision choice (views,
    copies, moves: Habana's lists name ``view``, apex's ``cpu``): skipped, so
    the script runs; nothing is cast through them and a view stays a view."""
    warnings.warn(
        f"hmp: {where}: not a precision choice (a cast there would break the program, not choose a "
        f"precision), so hmp skips it (docs/lists.md)",
        UserWarning,
        stacklevel=state.user_stacklevel(),
    )
