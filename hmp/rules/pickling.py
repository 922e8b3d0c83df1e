"""Pickling while converted.

pickle saves a function by name and checks that the name still finds that
very object. While converted, ``torch.nn.functional.relu`` is hmp's wrapper,
so the original ``F.relu`` that a model captured earlier (an
``nn.TransformerEncoderLayer`` holds it from its default argument) no longer
passes that check, and ``torch.save(model)`` would fail.

hmp's Pickler saves every function hmp replaced, and every wrapper, as "look
up this name when loading" (``pkgutil.resolve_name``): a plain process loads
the original, a converted one the wrapper, just as a name saved by pickle
itself would. ``pickle`` itself is left alone (``pickle.Pickler``,
``pickle.dump`` and ``pickle.dumps`` are the very objects they were). hmp's
Pickler reaches two places, through the patch log, only while converted:

- ``torch.save`` (on ``torch`` and ``torch.serialization``, one function):
  torch's documented entry point for saving a model takes the pickler as its
  ``pickle_module`` argument. hmp's ``torch.save`` passes ``PICKLE`` (pickle
  with hmp's Pickler) where the caller passed none or the stdlib ``pickle``,
  and otherwise calls torch's unchanged.
- ``multiprocessing.reduction.ForkingPickler.reducer_override`` (outside
  torch, as the library methods uncast_calls.txt names are): spawn-started DataLoader workers receive their
  dataset, collate_fn and worker_init_fn through ForkingPickler
  (tests/unit/test_interop_pickle.py::test_spawn_dataloader_while_converted
  fails without it). torch offers no way in: torch.multiprocessing uses the
  stdlib's ForkingPickler and only registers reducers by type
  (``ForkingPickler.register``), and the C pickler saves a plain function
  with ``save_global`` before it looks at any dispatch table, so a reducer
  registered for functions is never called; DataLoader builds the worker's
  ``Process`` with the dataset in its arguments, with no hook between.
- torch.distributed's object collectives (``all_gather_object``,
  ``broadcast_object_list``, ``gather_object``, ``send_object_list``...)
  pickle with the class in ``distributed_c10d._pickler``, read at each call.
  Without hmp's there, a sender of such an object raises while the other
  ranks wait in the collective until the process group times out: a hang.

Not covered: ``pickle.dump``/``pickle.dumps`` (or any pickler but these)
called directly while converted on an object that holds an original captured
before ``convert()``. pickle's own check fails: ``PicklingError: Can't pickle
<function relu ...>: it's not the same object as torch.nn.functional.relu``.
Use ``torch.save``, pickle the ``state_dict``, or build the model after
``convert()`` (it then holds the wrapper, which pickles by its name).
``copy.deepcopy`` copies functions by reference and is not affected.
See docs/leaves-alone.md.
"""

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
