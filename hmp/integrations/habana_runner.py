"""Run scripts written for Habana's hmp unchanged: ``python -m hmp run script.py [args]``.

A script written for Gaudi imports::

    from habana_frameworks.torch.hpex import hmp
    import habana_frameworks.torch.core as htcore
    ...
    htcore.mark_step()

``install()`` puts an import hook in front of ``sys.meta_path`` (nothing is
written to site-packages):

- ``habana_frameworks.torch.hpex.hmp`` is always this package, ``hmp``;
- without Habana software (no ``habana_frameworks`` on the path) small
  stand-in modules answer the rest of what such scripts touch:
  ``habana_frameworks.torch.core.mark_step()`` (a no-op: there is no lazy
  mode without Habana software), ``habana_frameworks.torch.hpu.is_available()``
  (False) and ``device_count()`` (0), and the HMP-era
  ``habana_frameworks.torch.utils.library_loader.load_habana_module()``
  (a no-op), and modules scripts import only to debug or profile
  (``habana_frameworks.torch.utils.debug``: every function a no-op). Any
  other ``habana_frameworks`` module is a ModuleNotFoundError that says so;
- with Habana software installed, everything but hmp comes from it.
"""

import argparse
import builtins
import importlib.abc
import importlib.machinery
import importlib.util
import io
import os
import runpy
import sys
import types
import zipfile

from hmp.diagnostics import errors

HMP_NAME = "habana_frameworks.torch.hpex.hmp"
# what HMP_NAME stands for: the package by name, which Python imports before any of its modules
PACKAGE = "hmp"
ROOT = "habana_frameworks"


def mark_step(*args, **kwargs):
    """Habana's ``htcore.mark_step()``; a no-op: without Habana software
    there is no lazy mode, every op has already run."""
    return None


def _false(*args, **kwargs):
    return False


def _zero(*args, **kwargs):
    return 0


def _nothing(*args, **kwargs):
    return None


def _debug_attr(module_name):
    """Module ``__getattr__`` of a debug-only stand-in: any function asked
    for is a no-op (there is nothing to dump or inspect without Habana
    software); dunder lookups fail as usual so imports and pickling behave."""

    def __getattr__(name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

        def no_op(*args, **kwargs):
            return None

        no_op.__name__ = no_op.__qualname__ = name
        no_op.__doc__ = f"hmp's no-op stand-in for {module_name}.{name} (Habana software is not installed)"
        return no_op

    return __getattr__


# stand-in module -> its attributes (every stand-in is a package, so the
# next level can be imported below it)
SHIMS = {
    "habana_frameworks": {},
    "habana_frameworks.torch": {},
    "habana_frameworks.torch.hpex": {},
    "habana_frameworks.torch.core": {"mark_step": mark_step},
    "habana_frameworks.torch.hpu": {"is_available": _false, "device_count": _zero},
    "habana_frameworks.torch.utils": {},
    "habana_frameworks.torch.utils.library_loader": {"load_habana_module": _nothing},
    "habana_frameworks.torch.utils.debug": {},
}
# Stand-ins for modules that real scripts import only to debug or profile
# (Model-References' hello_world/mnist.py imports
# habana_frameworks.torch.utils.debug as htdebug and never calls it; others
# call htdebug._dump_memory_reporter() and the like): every function is a
# no-op. Modules that do real HPU work (optimizers, hccl, media) stay errors.
DEBUG_ONLY = frozenset({"habana_frameworks.torch.utils.debug"})


class _Alias(importlib.abc.Loader):
    """Loads an existing module object under a second name, leaving its own
    ``__spec__`` as it was."""

    def __init__(self, module):
        self.module = module
        self._spec = None

    def create_module(self, spec):
        self._spec = self.module.__spec__
        return self.module

    def exec_module(self, module):
        module.__spec__ = self._spec  # the import system set it to the alias' spec


class HabanaFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``habana_frameworks.torch.hpex.hmp`` -> hmp; with ``shims``, the
    stand-in modules above as well."""

    def __init__(self, shims):
        self.shims = shims

    def find_spec(self, fullname, path=None, target=None):
        if fullname == HMP_NAME:
            return importlib.machinery.ModuleSpec(fullname, _Alias(importlib.import_module(PACKAGE)))
        if not self.shims or not (fullname == ROOT or fullname.startswith(ROOT + ".")):
            return None
        if fullname in SHIMS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        raise ModuleNotFoundError(
            f"No module named {fullname!r}: Habana software is not installed, and hmp run provides only "
            f"{', '.join(sorted(set(SHIMS) - {ROOT}) + [HMP_NAME])}",
            name=fullname,
        )

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        module.__dict__.update(SHIMS[module.__name__])
        if module.__name__ in DEBUG_ONLY:
            module.__getattr__ = _debug_attr(module.__name__)
        module.__doc__ = f"hmp's stand-in for {module.__name__} (Habana software is not installed)"


def _installed():
    """The hook in sys.meta_path, or None."""
    return next((f for f in sys.meta_path if isinstance(f, HabanaFinder)), None)


def habana_installed():
    """True when real Habana software (``habana_frameworks``) can be imported."""
    finder = _installed()
    if finder is not None and finder.shims:
        return False
    return importlib.util.find_spec(ROOT) is not None


def install():
    """Install the import hook (once); returns it."""
    finder = _installed()
    if finder is None:
        finder = HabanaFinder(shims=not habana_installed())
        sys.meta_path.insert(0, finder)
    return finder


def uninstall():
    """Remove the import hook and forget the modules it provided."""
    finder = _installed()
    if finder is None:
        return
    sys.meta_path.remove(finder)
    for name in [HMP_NAME] + (list(SHIMS) if finder.shims else []):
        sys.modules.pop(name, None)
    if not finder.shims:
        parent = sys.modules.get("habana_frameworks.torch.hpex")
        if parent is not None and getattr(parent, "hmp", None) is sys.modules.get(PACKAGE):
            delattr(parent, "hmp")


def run(script, args=()):
    """Run ``script`` as ``python script [args]`` would, with the hook installed:
    ``__name__ == "__main__"`` in a fresh module that is ``sys.modules["__main__"]``
    while it runs, an absolute ``__file__``, ``sys.argv == [script, *args]`` and
    ``sys.path[0]`` the script's directory. A directory or zip file runs its
    ``__main__.py``, as python does. A SystemExit from the script propagates."""
    script = os.fspath(script)
    install()
    sys.argv = [script, *args]
    directory = os.path.dirname(os.path.realpath(script))
    # what `python script.py` puts first, in place of the launcher's own entry
    # (the working directory for `python -m hmp`, the bin folder for `hmp`)
    if sys.path:
        sys.path[0] = directory
    else:
        sys.path.insert(0, directory)
    if os.path.isdir(script) or zipfile.is_zipfile(script):
        runpy.run_path(script, run_name="__main__")
        return
    path = os.path.abspath(script)  # python gives __main__ an absolute __file__ since 3.9
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=path,
        __cached__=None,
        __package__=None,
        __spec__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
        __builtins__=builtins,
    )
    previous = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if previous is not None:
            sys.modules["__main__"] = previous


def script_traceback(tb, path):
    """``tb`` from the script's first frame on (python shows none of its own
    frames above a script's); None when no frame is the script's."""
    while tb is not None and tb.tb_frame.f_code.co_filename != path:
        tb = tb.tb_next
    return tb


def add_parser(subparsers):
    p = subparsers.add_parser(
        "run",
        help="run a script written for Habana's hmp, unchanged",
        description="Run a script written for Habana's hmp (from habana_frameworks.torch.hpex import hmp, "
        "htcore.mark_step()) unchanged, on any machine. Arguments after the script are the script's.",
    )
    # optional to argparse, so that a missing script gets our message, not "script, args are required"
    p.add_argument("script", nargs="?", help="the script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.set_defaults(run=_cli)
    return p


def _cli(args):
    if args.script is None:
        print(
            "python -m hmp run: error: name the script to run: python -m hmp run train.py [its arguments]",
            file=sys.stderr,
        )
        return 2
    if not os.path.isfile(args.script) and not os.path.isdir(args.script):
        print(f"hmp run: can't open file {args.script!r}: no such file", file=sys.stderr)
        return 2  # what python itself returns for a missing script
    path = os.path.abspath(args.script)  # before the script can change directory
    try:
        run(args.script, args.args)
    except Exception as e:  # SystemExit and KeyboardInterrupt propagate, as from python
        # hmp rescues the script's uncaught error here: a dtype mismatch that passed
        # through nothing hmp wraps (an op in no list) gets its note now, while converted
        errors.explain(e)
        if os.path.isdir(path) or zipfile.is_zipfile(path):
            raise
        # reported as python reports it, without hmp's and runpy's frames above the script's
        tb = script_traceback(e.__traceback__, path)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        return 1
    return 0
