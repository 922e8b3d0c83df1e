"""A wrapper's identity: telling an hmp wrapper from what it wraps, and getting the
original back. Each wrapper is marked with the object it stands in for (``ORIGINAL``)
and its own id, so ``unwrap`` finds torch's own under hmp's layer but keeps another
library's wrapper on top (``functools.wraps`` copies the marks without the id).
Imports nothing of hmp."""

import functools

ORIGINAL = "__hmp_original__"  # set on every hmp wrapper, points at what it wraps
_MARKED = "__hmp_marked__"  # the id of the object ORIGINAL was set on


def mark(wrapper, original):
    """Mark ``wrapper`` as hmp's, standing in for ``original``. Returns ``wrapper``."""
    setattr(wrapper, ORIGINAL, original)
    setattr(wrapper, _MARKED, id(wrapper))
    return wrapper


def unwrap(obj):
    """What an hmp wrapper stands in for; anything else is itself. Another
    library's wrapper made with ``functools.wraps(hmp_wrapper)`` copies the
    marks, but not the id they name: it is not hmp's, and its layer is kept."""
    if getattr(obj, _MARKED, None) != id(obj):
        return obj
    return getattr(obj, ORIGINAL, obj)


def stand_in(wrapper, original):
    """Make ``wrapper`` stand in for ``original`` (name, docstring, ``__wrapped__``) with
    ``ORIGINAL`` pointing at torch's own, through stand-ins of stand-ins. Returns ``wrapper``."""
    try:
        functools.update_wrapper(wrapper, original)
    except (AttributeError, TypeError):  # a builtin without some of the names
        wrapper.__wrapped__ = original
    return mark(wrapper, unwrap(original))
