"""Op list files: reading, validating and combining them into effective lists.

Everything here runs before anything is patched, so a bad file raises with
torch untouched. Which file each list comes from, first match wins: the
argument, the environment (ENV_LISTS), the shipped default (DEFAULT_FILES).
"""

import logging
import os
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from . import state
from .resolve import NO_PYTHON, UNKNOWN, is_module_path, module_class

log = logging.getLogger("hmp")

KINDS = ("bf16", "fp32", "promote")
FILE_TITLE = {"bf16": "BF16 list file", "fp32": "FP32 list file", "promote": "promote list file"}
FP16_FILE_TITLE = "FP16 list file"
LIST_TITLE = {"bf16": "BF16", "fp32": "FP32", "promote": "promote"}  # the list itself, in messages
PARAMS = {"bf16": "bf16_file_path", "fp32": "fp32_file_path", "promote": "promote_file_path"}
DEFAULT_FILES = {
    "O1": {"bf16": "bf16.txt", "fp32": "fp32.txt", "promote": "promote.txt"},
    "O2": {"bf16": "o2_bf16.txt", "fp32": "o2_fp32.txt", "promote": "promote.txt"},
}
OPT_LEVELS = tuple(DEFAULT_FILES)
# Environment variables naming list files when convert() gets no path, in
# order of precedence: the names Lightning's HPU docs use, then the names
# Habana's autocast reads.
ENV_LISTS = {
    "bf16": ("LOWER_LIST", "PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST"),
    "fp32": ("FP32_LIST", "PT_HPU_AUTOCAST_FP32_OPS_LIST"),
}


class Names(NamedTuple):
    """Op names given directly (a gaudi config's list), already checked;
    they stand where a list file's path would."""

    names: list
    source: str  # where they came from, for messages


def list_dir():
    """The folder holding the shipped list files.

    Installed, it is ``hmp/op_lists``; in a source checkout it is the
    repository's ``op_lists/`` next to the package.
    """
    here = Path(__file__).resolve().parent
    installed = here / "op_lists"
    return installed if installed.is_dir() else here.parent / "op_lists"


def default_path(name):
    return list_dir() / name


def _check_path(path, what):
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"hmp: {what} must be a str or os.PathLike, got {type(path).__name__}: {path!r}")
    return Path(os.fspath(path))


MAX_BYTES = 64 << 20  # a list of every op torch has is under 100 KiB


def read_names(path, what="list file"):
    """Return ``[(line_number, name), ...]`` from a list file.

    Tolerates a UTF-8 BOM, CRLF, blank lines, surrounding whitespace and
    ``#`` comments. Raises OSError naming the path when it cannot be read and
    ValueError naming the path and line for text that is not a valid name.
    """
    path = _check_path(path, what)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # bounded: /dev/zero or a runaway pipe must not eat all memory
    except OSError as e:
        raise type(e)(e.errno, f"hmp: cannot read {what} {str(path)!r}: {e.strerror}", str(path)) from None
    except ValueError as e:  # a path the OS cannot take (an embedded NUL byte)
        raise ValueError(f"hmp: cannot read {what} {str(path)!r}: {e}") from None
    if len(data) > MAX_BYTES:
        raise ValueError(f"hmp: bad {what} {str(path)!r}: larger than {MAX_BYTES >> 20} MiB; a list file holds "
                         f"one op name per line")
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    entries = []
    errors = []
    # split on \n only so line numbers match what an editor shows
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            errors.append(f"line {number}: not valid UTF-8 ({e.reason} at byte {e.start})")
            continue
        name = text.split("#", 1)[0].strip()
        if not name:
            continue
        if not is_name(name):
            errors.append(f"line {number}: {_short(name)!r} is not an op name or a module class's import path")
            continue
        entries.append((number, name))
    if errors:
        raise ValueError(_error_text(path, what, errors))
    return entries


def is_name(text):
    """An op name (an identifier, or an aten operator and its overload,
    ``pow.Tensor_Scalar``, as Habana's autocast lists write them) or a
    module class's import path (``torch.nn.LSTM``): dotted identifiers."""
    return all(p.isascii() and p.isidentifier() for p in text.split("."))


_SANE = 80  # longer than any op name torch has


def _short(text, limit=_SANE):
    return text if len(text) <= limit else text[:limit] + "..."


SHOWN = 10  # errors listed in a message; the rest are counted


def _error_text(path, what, errors, limit=SHOWN):
    more = f"\n  ... and {len(errors) - limit} more" if len(errors) > limit else ""
    return f"hmp: bad {what} {str(path)!r}:\n  " + "\n  ".join(errors[:limit]) + more


class Entries(NamedTuple):
    """What one list holds: op names and module classes, in file order."""

    ops: list
    modules: list


def load(path, known, what, modules=True):
    """Read a list file and check every name with ``known.check(name)``
    (hmp.resolve.Resolver.check); a module class's import path is imported
    (the only code a list file can cause to run). ``modules=False``: module
    entries are an error (the promote list).

    Returns Entries: op names in file order, duplicates dropped, an overload
    qualified name as its op (``pow.Tensor_Scalar`` -> ``pow``), and the
    classes. A real aten operator that no Python name reaches is left out
    with one warning for the file; bad names raise ValueError naming the
    file and lines.
    """
    entries = read_names(path, what)
    errors, unreachable = [], []
    names, classes = {}, {}
    for number, name in entries:
        if name in names or name in classes:
            continue
        if is_module_path(name):
            try:
                if not modules:
                    raise ValueError(f"{name!r}: module entries go in the BF16 or FP32 list")
                classes[name] = module_class(name)
            except ValueError as e:
                op = name.rpartition(".")[2]
                if known.exists(op):  # torch.relu: an op written with its module
                    e = f"unknown op {name!r}; did you mean {op}? (an op is listed by its name alone; {e})"
                errors.append(f"line {number}: {e}")
            continue
        # suggestions cost milliseconds each (seconds for a huge name):
        # only for the errors shown, and only for names of a sane length
        sane = len(name) <= _SANE
        op, status, message = known.check(name, hint=sane and len(errors) < SHOWN)
        if status == UNKNOWN:
            errors.append(f"line {number}: {message if sane else f'unknown op {_short(name)!r}'}")
            continue
        if op != name:
            log.info("hmp: %s %s line %d: %s stands for aten::%s as a whole (hmp binds Python functions, "
                     "which reach every overload)", what, str(path), number, name, op)
        if status == NO_PYTHON:
            if op not in (o for _, o in unreachable):
                unreachable.append((number, op))
            continue
        names.setdefault(op, number)
    if errors:
        raise ValueError(_error_text(_check_path(path, what), what, errors))
    if unreachable:
        where = ", ".join(f"line {n}: aten::{op}" for n, op in unreachable)
        warn_unreachable(f"{what} {str(path)!r}: {where}")
    return Entries(list(names), list(dict.fromkeys(classes.values())))


def warn_unreachable(where):
    """The one warning for real aten operators that hmp cannot bind."""
    warnings.warn(f"hmp: {where}: nothing to bind in Python; calls reach it from C++, so hmp skips it "
                  f"(list the Python-level op that calls it instead, such as conv2d for convolutions)",
                  UserWarning, stacklevel=state.user_stacklevel())


def combine(bf16, fp32, promote, bf16_from_user, fp32_from_user, sources):
    """Apply the precedence rules and return ``{"bf16", "fp32", "promote"}`` sets.

    Two user files may not share an op. A single user file wins over the
    other, default list. The BF16 and FP32 lists win over the promote list.
    """
    bf16, fp32, promote = set(bf16), set(fp32), set(promote)
    both = bf16 & fp32
    if both:
        if bf16_from_user and fp32_from_user:
            raise ValueError(
                f"hmp: ops in both the BF16 list {sources['bf16']!r} and the FP32 list "
                f"{sources['fp32']!r}: {', '.join(sorted(both))}"
            )
        if bf16_from_user:
            log.info("hmp: BF16 list %s takes %s out of the default FP32 list", sources["bf16"], ", ".join(sorted(both)))
            fp32 -= both
        elif fp32_from_user:
            log.info("hmp: FP32 list %s takes %s out of the default BF16 list", sources["fp32"], ", ".join(sorted(both)))
            bf16 -= both
        else:
            raise ValueError(f"hmp: the default lists overlap: {', '.join(sorted(both))}")
    promote -= bf16 | fp32
    return {"bf16": bf16, "fp32": fp32, "promote": promote}


def given(path):
    """True for a path or names the caller gave; ``""`` and None mean "not given"."""
    return path is not None and not (isinstance(path, str) and path == "")


def _env_path(kind, environ):
    for var in ENV_LISTS.get(kind, ()):
        value = environ.get(var, "")
        if value:
            return value, var
    return "", None


def _low_list(bf16, fp16, low):
    """``(source, title)`` of the lower-precision list, as Habana's HMP chose
    it: ``fp16_file_path`` is that list when the lower dtype is float16 and
    is ignored (with a warning) under bfloat16. hmp also lets
    bf16_file_path name it under float16 when no fp16_file_path is given."""
    if not given(fp16):
        return bf16, FILE_TITLE["bf16"]
    if low != torch.float16:
        warnings.warn(f"hmp: fp16_file_path {fp16!r} is ignored: it names the list for "
                      f"low_precision_type=torch.float16, and the lower dtype is {low}", stacklevel=state.user_stacklevel())
        return bf16, FILE_TITLE["bf16"]
    if given(bf16):
        warnings.warn(f"hmp: bf16_file_path {bf16!r} is ignored: with low_precision_type=torch.float16 "
                      f"the lower-precision list is fp16_file_path {fp16!r}", stacklevel=state.user_stacklevel())
    return fp16, FP16_FILE_TITLE


def _load_one(source, resolver, title, kind):
    """``(Entries, printable source)`` for one list: a path or Names."""
    if isinstance(source, Names):
        return Entries(list(source.names), []), source.source
    printable = os.fspath(source) if isinstance(source, (str, os.PathLike)) else source
    return load(source, resolver, title, modules=kind != "promote"), printable


def effective(resolver, opt_level="O1", bf16="", fp32="", promote="", *, fp16="", low=torch.bfloat16, environ=None):
    """Read, validate and combine the lists: ``({"bf16", "fp32", "promote"}
    -> set of op names, {"bf16", "fp32"} -> module classes)``. Each of
    ``bf16``/``fp32``/``promote`` is a path, a Names, or ``""``/None for the
    environment's list, else the shipped default. ``fp16`` is the
    lower-precision list under ``low=torch.float16``. Raises before anything
    changes."""
    environ = os.environ if environ is None else environ
    titles = dict(FILE_TITLE)
    bf16, titles["bf16"] = _low_list(bf16, fp16, low)
    sources = {"bf16": bf16, "fp32": fp32, "promote": promote}
    for kind in ("bf16", "fp32"):
        if not given(sources[kind]):
            sources[kind], var = _env_path(kind, environ)
            if var:
                titles[kind] = f"{FILE_TITLE[kind]} (from ${var})"
                log.info("hmp: %s list from $%s: %s", kind, var, sources[kind])
    if opt_level == "O2":
        ignored = [titles[k] for k in ("bf16", "fp32") if given(sources[k])]
        if ignored:
            warnings.warn(f"hmp: opt_level O2 uses its own lists; ignoring the given {' and '.join(ignored)}",
                          stacklevel=state.user_stacklevel())
        sources["bf16"] = sources["fp32"] = ""
    from_user = {k: given(v) for k, v in sources.items()}
    loaded, printable = {}, {}
    for kind in KINDS:
        source = sources[kind] if from_user[kind] else default_path(DEFAULT_FILES[opt_level][kind])
        loaded[kind], printable[kind] = _load_one(source, resolver, titles[kind], kind)
    ops = combine(*(loaded[k].ops for k in KINDS), from_user["bf16"], from_user["fp32"], printable)
    classes = {k: loaded[k].modules for k in ("bf16", "fp32")}
    both = [c for c in classes["bf16"] if c in classes["fp32"]]
    if both:
        raise ValueError(f"hmp: module classes in both the BF16 list {printable['bf16']!r} and the FP32 list "
                         f"{printable['fp32']!r}: {', '.join(class_path(c) for c in both)}")
    return ops, classes


def class_path(cls):
    """The import path a list file names ``cls`` by."""
    return f"{cls.__module__}.{cls.__qualname__}"
