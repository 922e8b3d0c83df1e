"""Code that computes what the program keeps runs uncast: building modules, averaging,
merging and sampling with weights, like ``optimizer.step()`` (docs/never-changes.md).

Which code is data: ``op_lists/uncast_calls.txt`` (read by binding/uncast_list.py;
``uncast_file_path`` replaces or extends it), a dotted function or
``module.Class.method`` per line, covering every subclass that defines its own method.

``Class.__init__`` means construction: an instance runs uncast from its outermost
``__init__`` to its return. Only the class's own ``__init__`` is replaced, so no hmp
frame sits between one construction's ``__init__`` calls (Lightning's
``save_hyperparameters`` walks them); the outermost frame is found when the base
``__init__`` runs and a profile function says when it returns. An entry is resolved
only once the program imports its module (binding/imports.py); a subclass defined
while converted is wrapped as it is created. Every change goes through the patch log."""

import inspect
import logging
import sys
import types
import warnings

import torch

from hmp.binding.resolve import subclasses
from hmp.core.identity import stand_in, unwrap
from hmp.core.state import OFF, enter, first_time, leave, tls, user_stacklevel
from hmp.core.switches import uncast
from hmp.rules.interface import Changes

log = logging.getLogger("hmp")

# -- resolving: what to patch now --------------------------------------------------------------


def place_of(entry):
    """``(class or None, attribute owner, name)`` for an entry whose module is
    imported, or None. A module imported but lacking the attribute is a
    version of the library without it: left alone."""
    module = sys.modules.get(entry.module)
    if module is None:
        return None
    obj, parts = module, entry.qualname.split(".")
    for part in parts[:-1]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    if isinstance(obj, type):  # its subclasses may define the method even where it does not
        return obj, obj, parts[-1]
    if not hasattr(obj, parts[-1]):
        return None
    return None, obj, parts[-1]


def _wrapped(owner, name):
    """``owner.name`` (its own attribute) run uncast, keeping a static or class method's kind."""
    raw = inspect.getattr_static(owner, name)
    if isinstance(raw, staticmethod):
        return staticmethod(uncast(unwrap(raw.__func__)))
    if isinstance(raw, classmethod):
        return classmethod(uncast(unwrap(raw.__func__)))
    return uncast(unwrap(raw))


def _class_patches(cls, name):
    """The class's own ``name`` and every subclass's own, each once."""
    return [(c, name, _wrapped(c, name)) for c in dict.fromkeys(subclasses(cls)) if name in c.__dict__]


_UNCAST = uncast(lambda: None).__code__


def _is_ours(raw):
    return getattr(getattr(raw, "__func__", raw), "__code__", None) is _UNCAST


def changes(ctx):
    """The rule's changes (hmp/rules/interface.py): the entries resolvable now;
    ``ctx.watch`` resolves the others when the program imports their module."""
    calls = Calls(ctx.uncast, ctx.later)
    out = calls.patches()
    calls.on_import(ctx.watch)
    return Changes(tuple(out))


class Calls:
    """The entry points of one conversion and what resolving them patched."""

    def __init__(self, entries, later):
        self.entries = tuple(entries)
        self.later = later
        self.done = set()  # entries resolved

    def patches(self):
        """``[(namespace, attr, value)]`` for every entry resolvable now (the
        subclass hooks included); marks them resolved."""
        out = []
        for entry in self.entries:
            if entry in self.done:
                continue
            found = place_of(entry)
            if found is None:
                continue
            cls, owner, name = found
            self.done.add(entry)
            if cls is None:
                out.append((owner, name, _wrapped(owner, name)))
                continue
            if name == "__init__":
                out.append((cls, name, constructing(unwrap(inspect.getattr_static(cls, name)))))
                continue
            out += _class_patches(cls, name)
            out.append((cls, "__init_subclass__", _subclass_hook(cls, name, self.later)))
        return out

    def on_import(self, watch):
        """Have ``watch`` (imports.Watch) resolve the entries whose module the
        program imports later."""
        for module in sorted({e.module for e in self.entries if e not in self.done}):
            watch.add(module, self._imported)

    def _imported(self, module):
        for namespace, attr, value in self.patches():
            self.later(namespace, attr, value)
            log.info(
                "hmp: %s.%s runs uncast (%s imported after convert())",
                getattr(namespace, "__qualname__", namespace),
                attr,
                module.__name__,
            )


def _subclass_hook(cls, name, later):
    """``cls.__init_subclass__`` while converted: a subclass created then that
    defines its own ``name`` gets it wrapped too (through the patch log)."""
    previous = cls.__dict__.get("__init_subclass__")
    previous = getattr(getattr(previous, "__func__", None), _PREVIOUS, previous)  # an earlier conversion's: its own

    def __init_subclass__(sub, **kwargs):
        if previous is not None:
            previous.__func__(sub, **kwargs)
        else:
            super(cls, sub).__init_subclass__(**kwargs)
        if name in sub.__dict__ and not _is_ours(sub.__dict__[name]):
            later(sub, name, _wrapped(sub, name))

    setattr(__init_subclass__, _PREVIOUS, previous)
    return classmethod(__init_subclass__)


_PREVIOUS = "__hmp_previous__"  # on our __init_subclass__: what the class held before hmp


# -- construction: the outermost __init__ of an instance, uncast ------------------------------------

_is_compiling = torch.compiler.is_compiling


def constructing(init):
    """A base class's ``init`` that makes the whole construction of the
    instance it is called for run uncast (see the module's docstring)."""

    def __init__(self, *args, **kwargs):
        if tls.off != OFF and not _is_compiling():
            outer = _outermost_init(sys._getframe(1), self)
            if outer is not None and _uncast_until_return(outer):
                return init(self, *args, **kwargs)
            found = enter(OFF)  # no outer frame to wait for: the base __init__ alone
            try:
                return init(self, *args, **kwargs)
            finally:
                leave(found)
        return init(self, *args, **kwargs)

    return stand_in(__init__, init)


def _holds(frame, obj):
    """True when ``frame`` is a call made for ``obj``: an ``__init__`` (or a
    decorator's wrapper of one) whose first argument, or first element of
    its ``*args``, is ``obj``."""
    code = frame.f_code
    if not code.co_argcount and not code.co_flags & inspect.CO_VARARGS:
        return False
    first = frame.f_locals.get(code.co_varnames[0])
    if first is obj:
        return True
    return type(first) is tuple and bool(first) and first[0] is obj  # def wrapper(*args, **kwargs)


def _outermost_init(frame, obj):
    """The outermost frame of the calls that construct ``obj``, starting at
    ``frame`` (the caller of the base ``__init__``); None when ``frame`` is
    not one of them."""
    outer = None
    while frame is not None and _holds(frame, obj):
        if frame.f_code.co_name == "__init__" or outer is not None:
            outer = frame
        frame = frame.f_back
    return outer


def _uncast_until_return(outer):
    """Casts off in this thread until ``outer`` returns (or raises). A
    Python profile function already set is called on as before and put back
    after; a profiler written in C (cProfile) cannot be: then False, and
    hmp says once that constructions in that thread run uncast only inside
    the base ``__init__``."""
    previous = sys.getprofile()
    if previous is not None and not isinstance(previous, (types.FunctionType, types.MethodType)):
        if first_time("constructing under a profiler"):
            warnings.warn(
                "hmp: a profiler holds this thread, so modules built under it run uncast only inside "
                "torch.nn.Module.__init__, not in the rest of their constructors (a parameter computed "
                "there may be rounded). Build the model before profiling, or with hmp.disable_casts(). "
                "(hmp warns once.)",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        return False
    found = enter(OFF)

    def returned(frame, event, arg):
        if previous is not None:
            previous(frame, event, arg)
        if frame is outer and event == "return":
            sys.setprofile(previous)
            leave(found)

    sys.setprofile(returned)
    return True
