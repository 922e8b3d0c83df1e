"""TARGET of ``python -m hmp tune``, ``audit`` and ``profile``: a function
that takes no arguments and returns ``(step, state)``, named as
``my_module:make_step`` or ``path/to/file.py:make_step``. ``step()`` runs
one training step and returns its loss; ``state`` is a tuple of the
modules, optimizers and schedulers the step changes (the tools put them
back as they were after each of their runs)."""

import difflib
import importlib
import importlib.util
import inspect
import os
import sys

PREFIX = "_hmp_tune_target_"  # before a FILE.py target's name where another module holds that name
# kept: a tool run's imported target files (the command-line process only)
FILE_MODULES = set()  # the module names FILE.py targets were imported under
HELP = "MODULE:FUNCTION or FILE.py:FUNCTION, a function with no arguments that returns (step, state)"


def add_command(subparsers, name, summary, does, after=""):
    """The parser of a subcommand that takes TARGET, described one way:
    ``does`` (what it runs), then what TARGET is, then ``after``."""
    return subparsers.add_parser(
        name,
        help=summary,
        description=f"{does} TARGET is {HELP}: step() runs one training step and returns the loss; state is a "
        f"tuple of the modules and optimizers it changes{after}",
    )


class TargetError(ValueError):
    """TARGET cannot be loaded or does not return (step, state)."""


def load_target(spec):
    """The function ``spec`` names: ``module.path:function`` (imported as
    usual, the current directory first) or ``file.py:function``."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise TargetError(f"TARGET {spec!r}: expected MODULE:FUNCTION or FILE.py:FUNCTION, e.g. train:make_step")
    if where.endswith(".py") or os.sep in where or "/" in where:
        if not os.path.isfile(where):
            raise TargetError(f"TARGET {spec!r}: no file {os.path.abspath(where)!r}")
        module_name = _module_name(where)
        FILE_MODULES.add(module_name)
        spec_ = importlib.util.spec_from_file_location(module_name, where)
        module = importlib.util.module_from_spec(spec_)
        sys.modules[module_name] = module  # dataclasses and pickling look a module up by name
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))  # its own imports, as `python file.py`
        try:
            _run_module(spec_.loader.exec_module, module, spec)
        except TargetError:
            sys.modules.pop(module_name, None)  # no half-made module left behind
            raise
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = _run_module(importlib.import_module, where, spec)
        except ModuleNotFoundError as e:
            if e.name != where and not where.startswith(f"{e.name}."):
                raise
            raise TargetError(
                f"TARGET {spec!r}: no module {where!r} (run from the folder that holds it, or give "
                f"the file: path/to/{where.replace('.', '/')}.py:{name})"
            ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        functions = [n for n, v in vars(module).items() if callable(v) and not isinstance(v, type) and n[:1] != "_"]
        close = difflib.get_close_matches(name, functions, n=3)
        hint = f"; did you mean {' or '.join(f'{where}:{c}' for c in close)}?" if close else ""
        raise TargetError(f"TARGET {spec!r}: {getattr(module, '__file__', where)!r} has no function {name!r}{hint}")
    return fn


def _run_module(load, what, spec):
    """``load(what)``, where a file that is not valid Python (its own or one it imports) is a
    TargetError naming the file and line; any other exception its code raises is its own and
    keeps its traceback."""
    try:
        return load(what)
    except SyntaxError as e:
        where = f"{e.filename}, line {e.lineno}" if e.filename else "its source"
        raise TargetError(f"TARGET {spec!r}: {where}: {type(e).__name__}: {e.msg}") from None


def _module_name(path):
    """The name a FILE.py target is imported under: its own (``tune_my_model``),
    so a class defined in it is written to a tuned list file by a path that
    loads it again from that folder, as the file's own imports do; PREFIX +
    its name where that name is taken by another module."""
    name = os.path.splitext(os.path.basename(path))[0]
    if not name.isidentifier():
        return PREFIX + name
    try:
        found = sys.modules.get(name) or importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return PREFIX + name
    origin = getattr(found, "__file__", None) or getattr(found, "origin", None)
    if found is None or (origin and os.path.abspath(origin) == os.path.abspath(path)):
        return name
    return PREFIX + name  # a module of that name is installed or imported: keep clear of it


def _takes_no_arguments(fn, spec):
    """TargetError where ``fn`` cannot be called with no arguments, as TARGET is (checked on its
    signature, before it runs: a TypeError from inside ``fn`` is the user's own and keeps its traceback)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): the call itself tells
        return
    try:
        signature.bind()
    except TypeError:
        needed = [
            p.name
            for p in signature.parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        where, _, name = spec.rpartition(":")
        raise TargetError(
            f"TARGET {spec!r}: {name}() needs arguments ({', '.join(needed) or 'keyword-only ones'}), and TARGET "
            f"is called with none: write a function that takes none and returns (step, state) (it may call "
            f"{name} with the arguments you want), and give that as TARGET ({where}:FUNCTION)"
        ) from None


def make_target(fn, spec):
    """``(step, state)`` from ``fn()``, checked: ``fn`` must take no arguments."""
    _takes_no_arguments(fn, spec)
    made = fn()
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])):
        raise TargetError(
            f"TARGET {spec!r}: {getattr(fn, '__name__', fn)}() must return (step, state): a function "
            f"that runs one training step and returns its loss, and a tuple of the modules and "
            f"optimizers it changes; it returned {type(made).__name__}"
        )
    step, state = made
    state = () if state is None else tuple(state) if isinstance(state, (list, tuple)) else (state,)
    if not state:
        raise TargetError(
            f"TARGET {spec!r}: {getattr(fn, '__name__', fn)}() returned an empty state: it must hold the "
            f"modules and optimizers step() changes, e.g. (step, (model, optimizer)), so that each run "
            f"starts from the same weights"
        )
    return step, state


def user_name(cls):
    """``cls`` as a list file names it: its import path, which for a class
    from a FILE.py target is ``file.Class`` (the file is imported under its
    own name, so that path loads again from the file's folder); only where
    another module holds the file's name is it ``file.py:Class``, a form no
    list file takes (pass the class to convert(fp32_modules=[...]) instead)."""
    module = sys.modules.get(cls.__module__)
    if cls.__module__.startswith(PREFIX) and cls.__module__ in FILE_MODULES and getattr(module, "__file__", None):
        return f"{os.path.basename(module.__file__)}:{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"
