"""Entries resolved when the program imports their module (uncast calls,
module entries of libraries): hmp never imports a library for them. One
import hook while converted calls back after a watched module has run;
``revert()`` removes it (``runtime.handles``)."""

import fnmatch
import importlib.abc
import importlib.util
import sys
import threading

from hmp.core.state import runtime


class Watch:
    """What the hook is to look out for: module name patterns (``fnmatch``)
    and, for each, ``callback(module)`` run under the runtime lock once the
    module has been executed while converted."""

    def __init__(self):
        self.patterns = []  # (pattern, callback)

    def add(self, pattern, callback):
        self.patterns.append((pattern, callback))

    def callbacks(self, name):
        return [cb for pattern, cb in self.patterns if fnmatch.fnmatchcase(name, pattern)]

    def hook(self):
        """Install the import hook; returns a handle whose ``remove()`` takes it out."""
        finder = _Finder(self)
        sys.meta_path.insert(0, finder)
        return finder


def imported(pattern):
    """The modules already imported whose names match ``pattern``."""
    if not any(c in pattern for c in "*?["):
        module = sys.modules.get(pattern)
        return [module] if module is not None else []
    return [m for name, m in list(sys.modules.items()) if m is not None and fnmatch.fnmatchcase(name, pattern)]


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, watch):
        self.watch = watch
        self.local = threading.local()

    def find_spec(self, fullname, path, target=None):
        if getattr(self.local, "busy", False) or not self.watch.callbacks(fullname):
            return None
        self.local.busy = True  # the real spec, from the other finders
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.local.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, self.watch)
        return spec

    def remove(self):
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


class _Loader(importlib.abc.Loader):
    def __init__(self, loader, watch):
        self.loader, self.watch = loader, watch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        with runtime.lock:
            if runtime.conversion is None:
                return
            for callback in self.watch.callbacks(module.__name__):
                callback(module)

    def __getattr__(self, name):  # get_code, get_source, is_package, ... of the real loader
        return getattr(self.loader, name)
