"""The uncast-calls file (``op_lists/uncast_calls.txt``, or the user's
``uncast_file_path``): its lines, read with the list grammar
(list_files.Line), as dotted entry points. What running them uncast means is
hmp/rules/uncast_calls.py's."""

import sys
from typing import NamedTuple

from hmp.binding import list_files, lists

DEFAULT_FILE = "uncast_calls.txt"
TITLE = "uncast calls file"


class Entry(NamedTuple):
    """``module:qualname`` of one entry point; ``line`` for messages."""

    module: str
    qualname: str  # "Class.method" or "function"
    path: str  # the dotted path as written
    line: int


def load(path=""):
    """The entries of ``path`` (``""``/None: the shipped file), checked for
    their form only: a module is resolved when the program imports it."""
    default = list_files.default_path(DEFAULT_FILE)
    return entries(path if lists.given(path) else default, default)


def entries(source, default):
    """The entries of the file ``source`` (``include default`` reads ``default``)."""
    return tuple(_split(name, number) for number, name in _read(source, default))


def _read(source, default):
    lines, errors = list_files.read_lines(source, TITLE)
    out, bad, inert = [], [e for _, e in errors], []
    for line in lines:
        number, text = line.number, line.name
        if line.include:
            if text != "default":
                bad.append(f"line {number}: only 'include default' can be included here")
                continue
            out += _read(default, default)
        elif line.remove:
            kept = [(n, name) for n, name in out if name != text]
            if len(kept) == len(out):
                inert.append(f"line {number}: '-{text}'")
            out = kept
        elif "." not in text:
            bad.append(
                f"line {number}: {text!r} is no dotted path (package.module.function or package.module.Class.method)"
            )
        else:
            out.append((number, text))
    if bad:
        raise ValueError(list_files.error_text(list_files.check_path(source, TITLE), TITLE, bad))
    if inert:
        lists.warn_takes_out_nothing(f"{TITLE} {str(source)!r}: {'; '.join(inert)}", len(inert))
    return out


def _split(path, line):
    """Which prefix of ``path`` is the module: the longest one already
    imported; when none is, the one before the last part that starts with
    an upper-case letter (a class), else all but the last part."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:i]) in sys.modules:
            break
    else:
        i = next((j for j, p in enumerate(parts) if p[:1].isupper()), len(parts) - 1)
    return Entry(".".join(parts[:i]), ".".join(parts[i:]), path, line)
