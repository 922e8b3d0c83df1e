"""User functions and extension ops under the same rules as the lists.

``@hmp.bf16_function`` / ``@hmp.fp32_function`` / ``@hmp.promote_function``
decorate a function; ``hmp.register(owner, name, kind)`` wraps an attribute
of any object (a C++ extension op, a custom ``autograd.Function.apply``).
Both work whether they happen before or after ``convert()``, follow
``disable_casts()`` and the outermost-op rule, and do nothing while hmp is
not converted.
"""

import functools

from .state import tls

KINDS = ("bf16", "fp32", "promote")

# kind -> prepare(args, kwargs), set by convert() and cleared by revert()
active = None

# (owner, name, kind) registered with register(), applied at every convert()
registered = []


def _check_kind(kind):
    if kind not in KINDS:
        raise ValueError(f"hmp: kind must be one of {', '.join(KINDS)}, got {kind!r}")


def _decorator(kind):
    def decorate(fn):
        if not callable(fn):
            raise TypeError(f"hmp: {kind}_function needs a callable, got {fn!r}")

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            prepares = active
            if prepares is None or tls.off:
                return fn(*args, **kwargs)
            args, kwargs = prepares[kind](args, kwargs)
            tls.off = 1
            try:
                return fn(*args, **kwargs)
            finally:
                tls.off = 0

        return wrapper

    decorate.__name__ = f"{kind}_function"
    decorate.__doc__ = f"Run the decorated function under the {kind} list's rule while hmp is converted."
    return decorate


bf16_function = _decorator("bf16")
fp32_function = _decorator("fp32")
promote_function = _decorator("promote")


def register(owner, name, kind):
    """Wrap ``owner.name`` with the ``kind`` rule ("bf16", "fp32" or "promote")
    at every ``convert()`` from now on, and at once if already converted.
    ``revert()`` restores the original attribute."""
    _check_kind(kind)
    if not callable(getattr(owner, name, None)):
        raise ValueError(f"hmp: {owner!r} has no callable attribute {name!r}")
    from .convert import apply_registration, runtime

    with runtime.lock:
        entry = (owner, name, kind)
        registered[:] = [e for e in registered if not (e[0] is owner and e[1] == name)]
        registered.append(entry)
        if runtime.lists is not None:
            apply_registration(entry)


def unregister(owner, name):
    """Stop wrapping ``owner.name`` at later conversions (a current one keeps it until revert)."""
    registered[:] = [e for e in registered if not (e[0] is owner and e[1] == name)]


def owner_label(owner):
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or type(owner).__name__


__all__ = ["bf16_function", "fp32_function", "promote_function", "register", "unregister"]
