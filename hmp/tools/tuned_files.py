"""The list files hmp.tune writes. Each extends the default list of its kind
(``include default``) and holds only what differs from it: ``-name`` for an
entry taken out of the default, a name for one added. So the defaults' module
patterns (rotary and timestep embeddings, op_lists/fp32.txt) and every op
nobody touched stay as shipped, and a later hmp's defaults apply. A list
the user gave whole (a file without ``include default``: Conversion.replacing)
is written whole again, every entry a line: it replaced the default and still
does, whatever a later hmp's defaults hold.

Those lines are of two origins, written under a comment each and told apart
by ``split()``: the lines the lists tune started from already had (the
user's own: a list file given to convert(), say) and tune's changes. What a
page or a header says about a file comes from that split, never from a
guess."""

from __future__ import annotations

import torch

from hmp.binding.lists import default_path, load
from hmp.binding.module_entries import Pattern, class_path, entry_key, module_class, shown
from hmp.binding.resolve import Resolver

TOOL = "hmp.tune"
HEADER = (
    "# extends the default {kind} list: 'include default' keeps all of it (its ops and its module\n"
    "# patterns); each line after it changes it: '-name' takes a default entry out, a name adds one\n"
)
WHOLE = (
    "# replaces the default {kind} list, as the list tune started from did: each line is an entry, and\n"
    "# nothing else is in it (no 'include default': a later hmp's defaults do not change it)\n"
)
FROM_START = "# from the lists tune started from (already yours before tune ran):"
FROM_TUNE = "# tune's changes:"


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
    """What ``include default`` reads in a ``kind`` file (a kinds.Kind) given to
    ``hmp.convert()`` (opt_level O1, the lower dtype ``low``, ``strict``)."""
    path = default_path(kind.default_file("O1", low, strict))
    return load(path, Resolver(), "default list", modules=kind.takes_modules)


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


def entries(kind, ops, modules=()):
    """Every entry of ``kind``'s list as a line of a file that replaces the default: its ops, then its classes
    and patterns."""
    found = {entry_key(m): m for m in modules if isinstance(m, (type, Pattern))}
    return sorted(ops) + [written(m) for m in found.values()]


def split(kind, lists, modules, before=None, before_modules=None, low=torch.bfloat16, strict=False, whole=False):
    """``{"start": [...], "tune": [...]}``: the lines after ``include default`` that make ``kind``'s
    list (a kinds.Kind) hold ``lists[name]`` and ``modules[name]`` (by its public name, as a TuneResult
    keeps them), parted into those the starting lists (``before``, ``before_modules``; None: the
    default) have too, and the rest, tune's changes. ``whole``: the starting list replaced the default:
    every entry is a line (no ``include default``), ``"whole"`` is True and ``"dropped"`` names the
    starting list's entries tune took out."""
    name = kind.name
    if whole:
        lines = entries(kind, lists[name], modules.get(name, ()))
        start = entries(kind, before[name], (before_modules or {}).get(name, ())) if before is not None else []
        dropped = [x for x in start if x not in lines]
        return {
            "start": [x for x in lines if x in start],
            "tune": [x for x in lines if x not in start],
            "whole": True,
            "dropped": dropped,
        }
    lines = changes(kind, lists[name], modules.get(name, ()), low, strict)
    start = set()
    if before is not None:
        start = set(changes(kind, before[name], (before_modules or {}).get(name, ()), low, strict))
    return {"start": [x for x in lines if x in start], "tune": [x for x in lines if x not in start]}


def body(parts):
    """The text after the header: ``include default`` (not in a whole list), then each origin's lines under its
    comment."""
    lines = [] if parts.get("whole") else ["include default"]
    for heading, key in ((FROM_START, "start"), (FROM_TUNE, "tune")):
        if parts[key]:
            lines += [heading, *parts[key]]
    if parts.get("dropped"):
        lines.append(f"# tune took out: {', '.join(parts['dropped'])}")
    return "\n".join(lines) + "\n"


def texts(
    lists, modules, targets, summary, low=torch.bfloat16, strict=False, before=None, before_modules=None, whole=()
):
    """``[(path, text)]`` for ``targets``, ``[(kinds.Kind, path)]``: each file
    ``summary`` (comment lines), the header, ``include default`` and the
    lines (split(): the starting lists' own, then tune's changes); a kind in
    ``whole`` (public names: the starting list replaced the default) written
    whole. Raises ValueError for a class that does not load by its path."""
    note = instances(modules)
    if note:
        summary += f"# not in these files, give them to convert() again: module instances {', '.join(note)}\n"
    out = []
    for kind, path in targets:
        parts = split(kind, lists, modules, before, before_modules, low, strict, kind.name in whole)
        header = (WHOLE if parts.get("whole") else HEADER).format(kind=kind.title_in(low))
        out.append((path, summary + header + body(parts)))
    return out
