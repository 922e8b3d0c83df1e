"""What a module entry is: a line of a list file, or an item of convert()'s
``fp32_modules``/``bf16_modules``, that names a module class (its import
path), a pattern of class paths, or a module instance. Told apart from op
names, resolved to classes, matched against a model's module names, and
written back (``entry_key``, ``label``), all here; how an entry runs its
module is hmp/binding/modules.py's."""

import difflib
import fnmatch
import importlib
import sys
from typing import NamedTuple

import torch

from hmp.binding import imports
from hmp.binding.aten import aten_op

Module = torch.nn.Module


def is_module_path(name):
    """A dotted name that is not an aten operator and its overload: a
    module class's import path (``torch.nn.LSTM``)."""
    base, dot, rest = name.partition(".")
    return bool(dot) and ("." in rest or aten_op(base) is None)


def module_class(path):
    """The ``torch.nn.Module`` subclass the dotted import path names
    (``transformers.models.llama.modeling_llama.LlamaRMSNorm``), imported.
    Raises ValueError saying what was found instead."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
            break
        except ModuleNotFoundError as e:
            if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
                raise ValueError(f"importing {name!r} failed: {type(e).__name__}: {e}") from None
        except Exception as e:  # the module itself raised while importing
            raise ValueError(f"importing {name!r} failed: {type(e).__name__}: {e}") from None
    else:
        raise ValueError(f"{path!r} is no op and no importable path: no module named {parts[0]!r}")
    for j in range(i, len(parts)):
        try:
            obj = getattr(obj, parts[j])
        except AttributeError:
            raise ValueError(f"{path!r}: {'.'.join(parts[:j])!r} has no attribute {parts[j]!r}") from None
    if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
        return obj
    if isinstance(obj, type):
        raise ValueError(f"{path!r} is a class but not a torch.nn.Module subclass")
    if callable(obj):
        raise ValueError(f"{path!r} is a function, not a torch.nn.Module subclass")
    raise ValueError(f"{path!r} is a {type(obj).__name__}, not a torch.nn.Module subclass")


def is_pattern(text):
    """A module class's import path with ``fnmatch`` wildcards in its parts
    (``transformers.models.*.modeling_*.*RotaryEmbedding``)."""
    parts = text.split(".")
    return (
        len(parts) > 1
        and any(c in text for c in "*?")
        and all(p.isascii() and p.replace("*", "x").replace("?", "x").isidentifier() for p in parts)
    )


class Pattern(NamedTuple):
    """A module entry resolved when the program imports its module: a class
    path whose parts may hold ``fnmatch`` wildcards
    (``transformers.models.*.modeling_*.*RotaryEmbedding``), or a plain
    class path in a package not imported yet. hmp imports nothing for it."""

    path: str

    @property
    def module(self):
        return self.path.rpartition(".")[0]

    def classes(self, module=None):
        """The ``nn.Module`` subclasses it names in ``module``, or in every
        imported module it matches."""
        name = self.path.rpartition(".")[2]
        found = []
        for m in [module] if module is not None else imports.imported(self.module):
            for value in list(vars(m).values()):
                if (
                    isinstance(value, type)
                    and issubclass(value, torch.nn.Module)
                    and value.__module__ == m.__name__
                    and fnmatch.fnmatchcase(value.__name__, name)
                ):
                    found.append(value)
        return found


def entry_key(entry):
    """The text a module entry is known by: its class's path, or the pattern."""
    return entry.path if isinstance(entry, Pattern) else class_path(entry)


def class_path(cls):
    """The import path a list file names ``cls`` by."""
    return f"{cls.__module__}.{cls.__qualname__}"


def from_line(name, shipped):
    """The entry a list line names: the class, imported; or a Pattern,
    resolved when the program imports its module: a line with wildcards, and
    a shipped list's (``shipped``) class path in a package the program has
    not imported (a shipped list never imports a library)."""
    if is_pattern(name):
        return Pattern(name)
    if shipped and sys.modules.get(name.split(".")[0]) is None:  # not imported, or blocked (sys.modules[x] = None)
        return Pattern(name)
    return module_class(name)


def resolved(modules):
    """``modules`` (kind -> module entries) with each Pattern replaced by the classes
    it names now."""
    return {
        kind: tuple(dict.fromkeys(c for t in entries for c in (t.classes() if isinstance(t, Pattern) else [t])))
        for kind, entries in modules.items()
    }


# -- what convert() was given: classes, instances and names matched against the model ---------------------


def from_parameter(given, model, what):
    """The classes and instances named by ``given`` (an iterable of classes,
    module instances, or strings: name patterns matched against
    ``model.named_modules()``, else a class's import path). ``what``
    names the argument in errors. Raises before anything changes."""
    if given is None:
        return []
    if isinstance(given, (str, type, Module)):
        given = [given]
    out = []
    names = dict(model.named_modules()) if isinstance(model, Module) else None
    for i, item in enumerate(given):
        where = f"hmp: {what}[{i}]"
        if isinstance(item, type):
            if not issubclass(item, Module):
                raise TypeError(f"{where}: {item.__qualname__} is not a torch.nn.Module subclass")
            out.append(item)
        elif isinstance(item, Module):
            out.append(item)
        elif isinstance(item, str):
            out += _by_name(item, names, where)
        else:
            raise TypeError(
                f"{where}: expected a module class, a module or a name, got {type(item).__name__}: {item!r}"
            )
    return list(dict.fromkeys(out))


def _by_name(pattern, names, where):
    if names is not None:
        found = [m for name, m in names.items() if name and fnmatch.fnmatchcase(name, pattern)]
        if found:
            return found
    if is_module_path(pattern):
        try:
            return [module_class(pattern)]
        except ValueError as e:
            if names is None:
                raise ValueError(f"{where}: {e}{_did_you_mean(pattern, names)}") from None
    if names is None:
        raise ValueError(
            f"{where}: {pattern!r} is a module name pattern, and convert() got no model= to match "
            f"it against (or give the class, an instance or a class's import path){_did_you_mean(pattern, names)}"
        )
    close = fnmatch.filter(names, f"*{pattern.strip('*')}*")[:3] or [n for n in names if n][:3]
    raise ValueError(
        f"{where}: {pattern!r} matches no module of the model (its names look like "
        f"{', '.join(close)}) and is no module class's import path{_did_you_mean(pattern, names)}"
    )


def _did_you_mean(pattern, names):
    """A mistyped entry's close matches: the model's module names, and the import paths of the
    module classes (the model's and torch.nn's) whose class name is close to its last part."""
    classes = {}
    for cls in [type(m) for m in (names or {}).values()] + list(vars(torch.nn).values()):
        if isinstance(cls, type) and issubclass(cls, Module) and cls.__name__ not in classes:
            short = f"torch.nn.{cls.__name__}"
            classes[cls.__name__] = short if getattr(torch.nn, cls.__name__, None) is cls else class_path(cls)
    found = difflib.get_close_matches(pattern, [n for n in names or () if n], n=3, cutoff=0.8)
    found += [classes[c] for c in difflib.get_close_matches(pattern.rsplit(".", 1)[-1], list(classes), 3, 0.8)]
    return f"; did you mean {' or '.join(repr(f) for f in found)}?" if found else ""


def merge(from_files, given):
    """list kind (kinds.Kind) -> tuple of module entries: the list files' classes (``from_files``),
    then those given to convert() (``given``), for each kind that takes module
    entries; one entry under two kinds' rules is an error."""
    merged = {k: list(from_files.get(k, ())) + list(given.get(k, ())) for k in dict.fromkeys((*from_files, *given))}
    named = list(merged)
    for i, a in enumerate(named):
        for b in named[i + 1 :]:
            both = [t for t in merged[a] if any(t is u for u in merged[b])]
            if both:
                raise ValueError(
                    f"hmp: modules under both the {_title(a)} and the {_title(b)} rule: "
                    f"{', '.join(shown(t) for t in both)}"
                )
    return {k: tuple(dict.fromkeys(v)) for k, v in merged.items()}


def _title(kind):
    return kind.title_in(torch.bfloat16)  # Habana's name for the lower list's rule


def shown(entry):
    """A module entry as messages show it: a class's import path, a pattern,
    or an instance by its class and address (no list file can name one)."""
    if isinstance(entry, type):
        return class_path(entry)
    if isinstance(entry, Pattern):
        return entry.path
    return f"{type(entry).__qualname__} instance at {id(entry):#x}"
