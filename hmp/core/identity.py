"""A wrapper's identity: how any code tells an hmp wrapper from what it
wraps, and gets the original back. Every wrapper hmp installs is marked
(``mark``) with the object it stands in for (``ORIGINAL``) and with its own
id, so ``unwrap`` finds torch's own under hmp's layer but keeps another
library's wrapper stacked on top, whose ``functools.wraps`` copies the marks
without the id they name. ``stand_in`` makes a wrapper look like what it
replaces (name, docstring, ``__wrapped__``) and marks it. Imports nothing
of hmp, so every floor may use it."""

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
    """Make ``wrapper`` stand in for ``original``: its name, docstring and
    ``__wrapped__``, and ``ORIGINAL`` pointing at torch's own (what revert
    and a later convert unwrap to; through a stand-in of a stand-in too).
    Returns ``wrapper``."""
    try:
        functools.update_wrapper(wrapper, original)
    except (AttributeError, TypeError):  # a builtin without some of the names
        wrapper.__wrapped__ = original
    return mark(wrapper, unwrap(original))
