"""List files on disk: where the shipped ones live, and reading a file's
lines (the syntax of a line, and the errors a bad one raises). What the
lines mean, and how the lists combine, is lists.py's."""

import os
from pathlib import Path
from typing import NamedTuple

from hmp.binding.module_entries import is_pattern


def list_dir():
    """The folder holding the shipped list files.

    Installed, it is ``hmp/op_lists``; in a source checkout it is the
    repository's ``op_lists/`` next to the package.
    """
    here = Path(__file__).resolve().parent.parent  # hmp/
    installed = here / "op_lists"
    return installed if installed.is_dir() else here.parent / "op_lists"


def default_path(name):
    return list_dir() / name


def shipped_names():
    """The names of the shipped lists (``include <name>``, ``list_path``)."""
    return sorted(p.stem for p in list_dir().glob("*.txt"))


def list_path(name: str) -> Path:
    """The path of the shipped list ``name`` (``"bf16"``, ``"fp32"``,
    ``"promote"``, ``"fp16"``, ``"o2_bf16"``, ``"autocast_cpu_bf16"``, ...):
    the file to read, copy or name in ``include``."""
    if isinstance(name, str) and name.isidentifier() and (list_dir() / f"{name}.txt").is_file():
        return list_dir() / f"{name}.txt"
    raise ValueError(f"hmp: no shipped list named {name!r}; the shipped lists are {', '.join(shipped_names())}")


def check_path(path, what):
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"hmp: {what} must be a str or os.PathLike, got {type(path).__name__}: {path!r}")
    return Path(os.fspath(path))


MAX_BYTES = 64 << 20  # a list of every op torch has is under 100 KiB


class Line(NamedTuple):
    """One line of a list file, parsed (the grammar is read here only):
    ``name`` is an op name, a module class's import path or pattern, or with
    ``include`` the name of the list to include; ``remove`` for ``-name``."""

    number: int
    name: str
    remove: bool = False
    include: bool = False


def read_names(path, what="list file"):
    """The lines of a list file (``[Line, ...]``): each an op name or module
    path, ``-name`` or ``include <list>``.

    Tolerates a UTF-8 BOM, CRLF, blank lines, surrounding whitespace and
    ``#`` comments. Raises OSError naming the path when it cannot be read and
    ValueError naming the path and line for text that is not a valid line.
    """
    entries, errors = read_lines(path, what)
    if errors:
        raise ValueError(error_text(check_path(path, what), what, [e for _, e in errors]))
    return entries


def names(path, what="list file"):
    """The names a list file adds, in file order (its ``-name`` and
    ``include`` lines left out): a shipped file read as data."""
    return [line.name for line in read_names(path, what) if not (line.remove or line.include)]


def read_lines(path, what):
    """``(lines, errors)``: the valid lines of a list file (``Line``), and
    ``(line number, message)`` for each line that is not a valid one."""
    path = check_path(path, what)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # bounded: /dev/zero or a runaway pipe must not eat all memory
    except OSError as e:
        where = str(path) if path.is_absolute() else f"{str(path)!r} ({os.path.abspath(path)})"
        raise type(e)(e.errno, f"hmp: cannot read {what} {where}: {e.strerror}", str(path)) from None
    except ValueError as e:  # a path the OS cannot take (an embedded NUL byte)
        raise ValueError(f"hmp: cannot read {what} {str(path)!r}: {e}") from None
    if len(data) > MAX_BYTES:
        raise ValueError(
            f"hmp: bad {what} {str(path)!r}: larger than {MAX_BYTES >> 20} MiB; a list file holds one op name per line"
        )
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    entries = []
    errors = []
    # split on \n only so line numbers match what an editor shows
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            errors.append((number, f"line {number}: not valid UTF-8 ({e.reason} at byte {e.start})"))
            continue
        line = _line(number, text.split("#", 1)[0])
        if line is None:
            errors.append(
                (
                    number,
                    f"line {number}: {short(text.split('#', 1)[0].strip())!r} is not an op name, "
                    f"a module class's import path, '-name' or 'include <list>'",
                )
            )
        elif line.name:
            entries.append(line)
    return entries, errors


INCLUDE = "include"


def _line(number, text):
    """The parsed list line (an empty name for a blank one), or None when it
    is not a valid line."""
    text = text.strip()
    if not text or is_name(text) or is_pattern(text):
        return Line(number, text)
    if text.startswith("-") and (is_name(text[1:].strip()) or is_pattern(text[1:].strip())):
        return Line(number, text[1:].strip(), remove=True)
    words = text.split()
    if len(words) == 2 and words[0] == INCLUDE and is_name(words[1]):
        return Line(number, words[1], include=True)
    return None


def is_name(text):
    """An op name (an identifier, or an aten operator and its overload,
    ``pow.Tensor_Scalar``, as Habana's autocast lists write them) or a
    module class's import path (``torch.nn.LSTM``): dotted identifiers."""
    return all(p.isascii() and p.isidentifier() for p in text.split("."))


SANE = 80  # longer than any op name torch has


def short(text, limit=SANE):
    return text if len(text) <= limit else text[:limit] + "..."


SHOWN = 10  # errors listed in a message; the rest are counted


def error_text(path, what, errors, limit=SHOWN):
    more = f"\n  ... and {len(errors) - limit} more" if len(errors) > limit else ""
    return f"hmp: bad {what} {str(path)!r}:\n  " + "\n  ".join(errors[:limit]) + more
