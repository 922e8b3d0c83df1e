"""User functions and extension ops under the same rules as the lists.

``@hmp.bf16_function`` / ``@hmp.fp32_function`` / ``@hmp.promote_function``
decorate a function; ``hmp.register(owner, name, kind)`` wraps an attribute
of any object (a C++ extension op, a custom ``autograd.Function.apply``).
Both work whether they happen before or after ``convert()``, go through the
same wrapper as listed ops (``disable_casts()``, the outermost-op rule,
error notes), and cost nothing while hmp is not converted.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from hmp.binding import kinds, sites
from hmp.driver import conversion

F = TypeVar("F", bound=Callable)


def _check_kind(kind):
    if kind not in kinds.names():
        raise ValueError(f"hmp: kind must be one of {', '.join(kinds.names())}, got {kind!r}")


def _decorator(kind):
    def decorate(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"hmp: {kind.name}_function needs a callable, got {fn!r}")
        wrapper = sites.user_function(fn, kind)
        conversion.track_decorated(wrapper, kind)
        return wrapper

    decorate.__name__ = decorate.__qualname__ = f"{kind.name}_function"
    decorate.__doc__ = f"Run the decorated function under the {kind.title} list's rule while hmp is converted."
    return decorate


# one per kind, by its public name; a static name each, so that type checkers and IDEs see them
bf16_function = _decorator(kinds.LOWER)
fp32_function = _decorator(kinds.FP32)
promote_function = _decorator(kinds.PROMOTE)


def register(owner: object, name: str, kind: str) -> None:
    """Wrap ``owner.name`` with the ``kind`` rule ("bf16", "fp32" or "promote")
    at every ``convert()`` from now on, and at once if already converted.
    ``revert()`` restores the original attribute."""
    _check_kind(kind)
    if not callable(getattr(owner, name, None)):
        raise ValueError(f"hmp: {owner!r} has no callable attribute {name!r}")
    conversion.register(owner, name, kinds.kind(kind))


def unregister(owner: object, name: str) -> None:
    """Stop wrapping ``owner.name`` at later conversions (a current one keeps it until revert)."""
    conversion.unregister(owner, name)
