"""Pickling while converted.

pickle saves a function by name and checks the name still finds that object; while
converted ``F.relu`` is hmp's wrapper, so an original a model captured earlier fails
that check. hmp's Pickler saves every replaced function and every wrapper as "look up
this name when loading" (``pkgutil.resolve_name``). ``pickle`` itself is left alone;
hmp's Pickler reaches three places, through the patch log, only while converted:

- ``torch.save`` passes it as ``pickle_module`` where the caller passed none or ``pickle``;
- ``ForkingPickler.reducer_override``, for spawn-started DataLoader workers;
- torch.distributed's object collectives (``distributed_c10d._pickler``), where a
  failing sender would hang the other ranks.

Not covered: ``pickle.dump``/``dumps`` called directly on an object holding an
original captured before convert(); use ``torch.save``, the ``state_dict``, or build
the model after convert() (docs/leaves-alone.md)."""

import io
import pickle
import pkgutil
import types
from multiprocessing import reduction

import torch

from hmp.core import torch_private
from hmp.core.identity import stand_in, unwrap
from hmp.core.state import runtime
from hmp.rules.interface import Changes


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


class _PickleModule(types.ModuleType):
    """``pickle`` with hmp's ``Pickler``, ``dump`` and ``dumps``: what hmp's
    ``torch.save`` gives torch's as ``pickle_module`` (torch subclasses its
    ``Pickler`` and calls its ``dump``). Any other name is pickle's."""

    Pickler = Pickler
    dump = staticmethod(dump)
    dumps = staticmethod(dumps)

    def __getattr__(self, name):
        return getattr(pickle, name)


PICKLE = _PickleModule(f"{__name__}.PICKLE")


def _save(original):
    def save(obj, f, pickle_module=pickle, *args, **kwargs):
        if pickle_module is pickle:
            pickle_module = PICKLE
        return original(obj, f, pickle_module, *args, **kwargs)

    return stand_in(save, original)


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


def names(records):
    """``{id: (function, path)}`` for the (namespace, attr, previous, value)
    records of the undo log whose value a path finds; the replaced
    originals get the same path."""
    out = {}
    for namespace, attr, previous, value, _ in records:
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


def changes(ctx):
    """The rule's changes (hmp/rules/interface.py): ``torch.save`` giving
    torch hmp's Pickler, ForkingPickler's ``reducer_override`` and the object
    collectives' Pickler (see above)."""
    original = unwrap(torch.serialization.save)
    save = _save(original)
    homes = [ns for ns in (torch, torch.serialization) if unwrap(getattr(ns, "save", None)) is original]
    saves = tuple((ns, "save", save) for ns in homes)
    collectives = torch_private.object_collectives_pickler_home()
    objects = ((*collectives, Pickler),) if collectives is not None else ()
    return Changes((*saves, (reduction.ForkingPickler, "reducer_override", _reducer_override), *objects))
