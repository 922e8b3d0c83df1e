"""The list files hmp.tune writes. Each extends the default list of its kind
(``include default``) and holds only tune's changes: ``-name`` for an entry
taken out of the default, a name for one added. So the defaults' module
patterns (rotary and timestep embeddings, op_lists/fp32.txt) and every op
tune did not touch stay as shipped, and a later hmp's defaults apply."""

from __future__ import annotations

import torch

from hmp.core import kinds
from hmp.core.lists import default_path, load
from hmp.core.module_entries import Pattern, class_path, entry_key, module_class, shown
from hmp.core.resolve import Resolver

TOOL = "hmp.tune"
HEADER = (
    "# extends the default {kind} list: 'include default' keeps all of it (its ops and its module\n"
    "# patterns); the lines after it are tune's changes: '-name' takes a default entry out, a name adds one\n"
)


def importable(cls):
    """``cls``'s import path, checked to load ``cls`` again."""
    path = class_path(cls)
    try:
        found = module_class(path)
    except ValueError as e:
        found, why = None, str(e)
    else:
        why = f"it names another class, {found!r}"
    if found is not cls:
        raise ValueError(
            f"{TOOL}: cannot write the module class {cls.__qualname__} to a list file: its import path "
            f"{path!r} does not load it ({why}). Define the class at the top level of an importable "
            f"module, or write the files without it and pass it to hmp.convert(fp32_modules=[...])."
        )
    return path


def default_entries(kind, low=torch.bfloat16, strict=False):
    """What ``include default`` reads in a ``kind`` file given to
    ``hmp.convert()`` (opt_level O1, the lower dtype ``low``, ``strict``)."""
    record = kinds.kind(kind)
    path = default_path(record.default_file("O1", low, strict))
    return load(path, Resolver(), "default list", modules=record.takes_modules)


def written(entry):
    """A module entry as a list line: a class's checked import path, a pattern's text."""
    return importable(entry) if isinstance(entry, type) else entry.path


def changes(kind, ops, modules=(), low=torch.bfloat16, strict=False):
    """The lines after ``include default`` that make ``kind``'s list hold
    exactly ``ops`` and the classes and patterns among ``modules``."""
    default = default_entries(kind, low, strict)
    ops = set(ops)
    entries = {entry_key(m): m for m in modules if isinstance(m, (type, Pattern))}
    shipped = [entry_key(m) for m in default.modules]
    return (
        [f"-{op}" for op in default.ops if op not in ops]
        + sorted(ops - set(default.ops))
        + [f"-{key}" for key in shipped if key not in entries]
        + [written(m) for key, m in entries.items() if key not in shipped]
    )


def instances(modules):
    """The module instances among the entries: a list file cannot name them."""
    return [shown(t) for targets in modules.values() for t in targets if not isinstance(t, (type, Pattern))]


def texts(lists, modules, targets, summary, low=torch.bfloat16, strict=False):
    """``[(path, text)]`` for ``targets``, ``[(kind, path)]``: each file
    ``summary`` (comment lines), the header, ``include default`` and the
    changes. Raises ValueError for a class that does not load by its path."""
    note = instances(modules)
    if note:
        summary += f"# not in these files, give them to convert() again: module instances {', '.join(note)}\n"
    out = []
    for kind, path in targets:
        lines = ["include default", *changes(kind, lists[kind], modules.get(kind, ()), low, strict)]
        out.append((path, summary + HEADER.format(kind=kinds.kind(kind).title_in(low)) + "\n".join(lines) + "\n"))
    return out
