"""Pickling while converted.

pickle saves a function by name and checks that the name still finds that
very object. While converted, ``torch.nn.functional.relu`` is hmp's wrapper,
so the original ``F.relu`` that a model captured earlier (an
``nn.TransformerEncoderLayer`` holds it from its default argument) no longer
passes that check, and ``torch.save(model)`` fails.

While converted, hmp's Pickler saves every function it replaced, and every
wrapper, as "look up this name when loading" (``pkgutil.resolve_name``): a
plain process loads the original, a converted one the wrapper, just as a
name saved by pickle itself would. It is installed, through the patch log,
where picklers are made: ``pickle.Pickler`` (what ``torch.save`` subclasses
on every call), ``pickle.dump``/``pickle.dumps``, and
``multiprocessing.reduction.ForkingPickler`` (spawn-started DataLoader
workers). A pickler made before convert() (or a Pickler subclass defined
before it) is not covered; see docs/leaves-alone.md.
"""

import io
import pickle
import pkgutil
import types
from multiprocessing import reduction

from hmp.core.state import runtime


def _reduce(obj):
    entry = runtime.pickle_names.get(id(obj))
    if entry is not None and entry[0] is obj:
        return pkgutil.resolve_name, (entry[1],)
    return NotImplemented


class Pickler(pickle.Pickler):
    """pickle.Pickler that saves replaced functions and hmp wrappers by name."""

    def reducer_override(self, obj):
        return _reduce(obj)


def _reducer_override(self, obj):  # for ForkingPickler, a class hmp does not own
    return _reduce(obj)


def dump(obj, file, protocol=None, *, fix_imports=True, buffer_callback=None):
    Pickler(file, protocol, fix_imports=fix_imports, buffer_callback=buffer_callback).dump(obj)


def dumps(obj, protocol=None, *, fix_imports=True, buffer_callback=None):
    f = io.BytesIO()
    dump(obj, f, protocol, fix_imports=fix_imports, buffer_callback=buffer_callback)
    return f.getvalue()


def _path(namespace, attr):
    if isinstance(namespace, types.ModuleType):
        return f"{namespace.__name__}:{attr}"
    if isinstance(namespace, type):
        return f"{namespace.__module__}:{namespace.__qualname__}.{attr}"
    return None


def _own_name(value):
    """True for hmp's own module-level functions (regions.worker_loop): pickle
    saves them under their own hmp name, which a spawned process must import
    to run them; the patched name would find torch's function there."""
    module = getattr(value, "__module__", None) or ""
    if module != "hmp" and not module.startswith("hmp."):
        return False
    try:
        return pkgutil.resolve_name(f"{module}:{value.__qualname__}") is value
    except Exception:
        return False


def names(entries):
    """``{id: (function, path)}`` for the (namespace, attr, previous, value)
    entries of the patch log whose value a path finds; the replaced
    originals get the same path."""
    out = {}
    for namespace, attr, previous, value, _ in entries:
        path = _path(namespace, attr)
        if path is None or not callable(value):
            continue
        try:
            found = pkgutil.resolve_name(path)
        except Exception:  # a namespace that is not importable by name
            continue
        if found is not value or _own_name(value):
            continue
        out[id(value)] = (value, path)
        if callable(previous) and not isinstance(previous, type):
            out[id(previous)] = (previous, path)
    return out


def patches():
    """``[(namespace, attr, value)]`` that point the picklers at hmp's."""
    return [
        (pickle, "Pickler", Pickler),
        (pickle, "dump", dump),
        (pickle, "dumps", dumps),
        (reduction.ForkingPickler, "reducer_override", _reducer_override),
    ]
