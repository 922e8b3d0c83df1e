"""Op list files: reading, validating and combining them into effective lists.

Everything here runs before anything is patched, so a bad file raises with
torch untouched. Which file each list comes from, first match wins: the
argument, the environment (ENV_LISTS), the shipped default (``default_file``).

Besides op names and module paths, a line may be ``include default`` (the
default list of the file's kind), ``include <name>`` (a shipped list,
``list_path(name)``) or ``-name`` (take ``name`` out of what the file
holds), so a file can extend a default list instead of replacing it. A list
holds precision choices only: names of ops that alias, copy, move or only
write data are skipped with a warning (refusals.py). Reading a file's lines
and finding the shipped files is list_files.py's.
"""

import functools
import logging
import os
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from hmp.core import pays, refusals, state
from hmp.core.list_files import (
    INCLUDE,
    SANE,
    SHOWN,
    check_path,
    default_path,
    error_text,
    list_dir,
    list_path,
    read_lines,
    read_names,
    short,
)
from hmp.core.module_entries import entry_key, from_line, is_module_path, is_pattern
from hmp.core.refusals import refusal
from hmp.core.resolve import BOUND, NO_PYTHON, UNKNOWN

# uncast_calls reads the line reader through lists (its old names)
_read_lines, _check_path, _error_text = read_lines, check_path, error_text

log = logging.getLogger("hmp")

KINDS = ("bf16", "fp32", "promote")
FILE_TITLE = {"bf16": "BF16 list file", "fp32": "FP32 list file", "promote": "promote list file"}
FP16_FILE_TITLE = "FP16 list file"
LIST_TITLE = {"bf16": "lower-precision", "fp32": "FP32", "promote": "promote"}  # the list itself, in messages
_LOWER_TITLE = {torch.bfloat16: "BF16", torch.float16: "FP16"}


def list_title(kind, low=None):
    """A list's name in messages: the lower list ("bf16" in files and
    parameters, for Habana's names) by the dtype it runs in, where known."""
    return _LOWER_TITLE.get(low, LIST_TITLE[kind]) if kind == "bf16" else LIST_TITLE[kind]


PARAMS = {"bf16": "bf16_file_path", "fp32": "fp32_file_path", "promote": "promote_file_path"}
DEFAULT_FILES = {
    "O1": {"bf16": "bf16.txt", "fp32": "fp32.txt", "promote": "promote.txt"},
    "O2": {"bf16": "o2_bf16.txt", "fp32": "o2_fp32.txt", "promote": "promote.txt"},
}
OPT_LEVELS = tuple(DEFAULT_FILES)
# strict=True under O1: Habana's BF16 list, which also names the entries that cast only in strict
# mode (pointwise ops, normalisations, dropout: hmp/core/pays.py)
STRICT_LOWER_FILE = "bf16_strict.txt"
# float16 overflows above 65504: its O1 lower list is the GEMM/convolution
# family, as torch.autocast's and apex O1's float16 lists (the seed's BF16
# list stays available: ``include bf16``). O2's lower list already is.
FP16_LOWER_FILE = "fp16.txt"
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


# Ops in no list that fail when a lower-precision tensor reaches them (no
# kernel for its dtype, or they need one dtype), found from torch itself by
# benchmarks/kernel_lists.py: they run as they would without hmp's cast.
NO_KERNEL_FILES = {torch.bfloat16: "no_kernel_bf16.txt", torch.float16: "no_kernel_fp16.txt"}
ONE_DTYPE_FILE = "one_dtype.txt"


@functools.lru_cache(maxsize=None)
def fallback_names(low):
    """``(("fp32", names), ("promote", names))``: the ops that get the FP32
    rule (no kernel for ``low``) and the promote rule (they need one dtype)
    when they are in no list. Shipped and checked by the test suite, so
    read without checking each name again."""
    return (
        ("fp32", tuple(n for _, n in read_names(default_path(NO_KERNEL_FILES[low])))),
        ("promote", tuple(sorted(one_dtype_names()))),
    )


@functools.lru_cache(maxsize=None)
def one_dtype_names():
    """The ops that need all their floating inputs in one dtype (op_lists/one_dtype.txt):
    the only ones whose promotion torch does not do itself."""
    return frozenset(n for _, n in read_names(default_path(ONE_DTYPE_FILE)))


def default_file(opt_level, kind, low=torch.bfloat16, strict=False):
    """The shipped file of ``kind``'s default list."""
    if kind == "bf16" and opt_level == "O1":
        if low == torch.float16:
            return FP16_LOWER_FILE
        if strict:
            return STRICT_LOWER_FILE
    return DEFAULT_FILES[opt_level][kind]


class Entries(NamedTuple):
    """What one list holds: op names and module classes, in file order;
    ``explicit``: the op names the file itself names (not through ``include``)."""

    ops: list
    modules: list
    explicit: frozenset = frozenset()


def load(path, known, what, modules=True, default=None):
    """Read a list file and check every name with ``known.check(name)``
    (hmp.core.resolve.Resolver.check); a module class's import path is imported
    (the only code a list file can cause to run). ``modules=False``: module
    entries are an error (the promote list). ``default``: the path that
    ``include default`` reads.

    Returns Entries: op names in file order, duplicates dropped, an overload
    qualified name as its op (``pow.Tensor_Scalar`` -> ``pow``), and the
    classes. A real aten operator that no Python name reaches is left out
    with one warning for the file; bad lines (syntax, unknown or refused
    names, all of them at once) raise ValueError naming the file and lines.
    """
    entries, syntax = read_lines(path, what)
    r = _Reading(path, known, what)
    for number, name in entries:
        if name.startswith(INCLUDE):
            r.include(number, name, modules, default)
            continue
        remove = name.startswith("-")
        name = name[1:] if remove else name
        if not remove and (name in r.explicit or name in r.classes):
            continue
        if is_pattern(name) or is_module_path(name):
            r.module_line(number, name, remove, modules)
        else:
            r.op_line(number, name, remove)
    return r.entries(syntax)


class _Reading:
    """What load() gathers from one file's lines, in file order."""

    def __init__(self, path, known, what):
        self.path, self.known, self.what = path, known, what
        self.errors, self.unreachable, self.skipped = [], [], []
        self.names, self.classes, self.explicit, self.removed = {}, {}, set(), {}

    def include(self, number, name, modules, default):
        target = name[len(INCLUDE) :]
        try:
            source = default if target == "default" else list_path(target)
            if source is None:
                raise ValueError("no default list here")
            included = load(source, self.known, f"list {target!r}", modules)
        except ValueError as e:
            self.errors.append((number, f"line {number}: {name!r}: {str(e).replace('hmp: ', '')}"))
            return
        for op in included.ops:
            self.names.setdefault(op, number)
        for entry in included.modules:
            self.classes.setdefault(entry_key(entry), entry)

    def module_line(self, number, name, remove, modules):
        try:
            if not modules:
                raise ValueError(f"{name!r}: module entries go in the BF16 or FP32 list")
            entry = from_line(name, _shipped(self.path))
            if remove:  # as written (how an included pattern is known) and as the class it names
                self.removed[name] = self.removed[entry_key(entry)] = number
            else:
                self.classes[name] = entry
        except ValueError as e:
            op = name.rpartition(".")[2]
            if self.known.exists(op):  # torch.relu: an op written with its module
                e = f"unknown op {name!r}; did you mean {op}? (an op is listed by its name alone; {e})"
            self.errors.append((number, f"line {number}: {e}"))

    def op_line(self, number, name, remove):
        # suggestions cost milliseconds each (seconds for a huge name):
        # only for the errors shown, and only for names of a sane length
        sane = len(name) <= SANE
        op, status, message = self.known.check(name, hint=sane and len(self.errors) < SHOWN)
        if status == UNKNOWN:
            self.errors.append((number, f"line {number}: {message if sane else f'unknown op {short(name)!r}'}"))
            return
        reason = refusal(op) if status == BOUND else None  # an unbindable name is skipped below anyway
        if reason is not None and not remove:
            self.skipped.append(f"line {number}: {op!r} ({reason})")
            return
        if op != name:
            log.info(
                "hmp: %s %s line %d: %s stands for aten::%s as a whole (hmp binds Python functions, "
                "which reach every overload)",
                self.what,
                str(self.path),
                number,
                name,
                op,
            )
        if remove:
            self.removed[op] = number
            return
        if status == NO_PYTHON:
            if op not in (o for _, o in self.unreachable):
                self.unreachable.append((number, op))
            return
        self.names.setdefault(op, number)
        self.explicit.add(op)

    def entries(self, syntax):
        """The Entries read; raises for every bad line at once, warns once for the skipped ones."""
        path, what, names, removed, explicit = self.path, self.what, self.names, self.removed, self.explicit
        errors = self.errors
        both = [(n, op) for op, n in removed.items() if op in explicit]
        errors += [(n, f"line {n}: {op!r} is both listed (line {names[op]}) and taken out ('-{op}')") for n, op in both]
        if errors or syntax:
            errors = [e for _, e in sorted(syntax + errors, key=lambda e: e[0])]
            raise ValueError(error_text(check_path(path, what), what, errors))
        if self.unreachable:
            where = ", ".join(f"line {n}: aten::{op}" for n, op in self.unreachable)
            warn_unreachable(f"{what} {str(path)!r}: {where}")
        if self.skipped:
            refusals.warn_skipped(f"{what} {str(path)!r}: {'; '.join(self.skipped)}")
        ops = [op for op in names if op not in removed]
        found = [e for key, e in self.classes.items() if key not in removed and entry_key(e) not in removed]
        return Entries(ops, list(dict.fromkeys(found)), frozenset(explicit))


def _shipped(path):
    """True for a file among the shipped lists."""
    return Path(os.fspath(path)).resolve().parent == list_dir().resolve()


def how_to_add(name, kind, low=None):
    """Advice that keeps the default list: how to put ``name`` in ``kind``'s list."""
    return (
        f"put '{name}' in a file whose first line is 'include default' and pass it as {PARAMS[kind]}, so the "
        f"default {list_title(kind, low)} list stays in force"
    )


def warn_unreachable(where):
    """The one warning for real aten operators that hmp cannot bind."""
    warnings.warn(
        f"hmp: {where}: nothing to bind in Python; calls reach it from C++, so hmp skips it "
        f"(list the Python-level op that calls it instead, such as conv2d for convolutions)",
        UserWarning,
        stacklevel=state.user_stacklevel(),
    )


def combine(bf16, fp32, promote, sources):
    """Apply the precedence rules to three Entries and return ``{"bf16",
    "fp32", "promote"}`` sets.

    An op a file names itself wins over the same op included in the other
    list (a user BF16 file naming softmax takes it out of the default FP32
    list); named in both, or included in both, it is an error. The BF16 and
    FP32 lists win over the promote list.
    """
    low, high = set(bf16.ops), set(fp32.ops)
    both = low & high
    clash = sorted(op for op in both if (op in bf16.explicit) == (op in fp32.explicit))
    if clash:
        raise ValueError(
            f"hmp: ops in both the BF16 list {sources['bf16']!r} and the FP32 list "
            f"{sources['fp32']!r}: {', '.join(clash)}"
        )
    moved = {
        "bf16": sorted(op for op in both if op in bf16.explicit),
        "fp32": sorted(op for op in both if op in fp32.explicit),
    }
    if moved["bf16"]:
        log.info("hmp: BF16 list %s takes %s out of the FP32 list", sources["bf16"], ", ".join(moved["bf16"]))
    if moved["fp32"]:
        log.info("hmp: FP32 list %s takes %s out of the BF16 list", sources["fp32"], ", ".join(moved["fp32"]))
    high -= set(moved["bf16"])
    low -= set(moved["fp32"])
    return {"bf16": low, "fp32": high, "promote": set(promote.ops) - low - high}


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
        warnings.warn(
            f"hmp: fp16_file_path {fp16!r} is ignored: it names the list for "
            f"low_precision_type=torch.float16, and the lower dtype is {low}",
            stacklevel=state.user_stacklevel(),
        )
        return bf16, FILE_TITLE["bf16"]
    if given(bf16):
        warnings.warn(
            f"hmp: bf16_file_path {bf16!r} is ignored: with low_precision_type=torch.float16 "
            f"the lower-precision list is fp16_file_path {fp16!r}",
            stacklevel=state.user_stacklevel(),
        )
    return fp16, FP16_FILE_TITLE


def _load_one(source, resolver, title, kind, default):
    """``(Entries, printable source)`` for one list: a path or Names."""
    if isinstance(source, Names):
        return Entries(list(source.names), [], frozenset(source.names)), source.source
    printable = os.fspath(source) if isinstance(source, (str, os.PathLike)) else source
    return load(source, resolver, title, modules=kind != "promote", default=default), printable


def effective(
    resolver, opt_level="O1", bf16="", fp32="", promote="", *, fp16="", low=torch.bfloat16, strict=False, environ=None
):
    """Read, validate and combine the lists: ``({"bf16", "fp32", "promote"}
    -> set of op names, {"bf16", "fp32"} -> module classes)``. Each of
    ``bf16``/``fp32``/``promote`` is a path, a Names, or ``""``/None for the
    environment's list, else the shipped default. ``fp16`` is the
    lower-precision list under ``low=torch.float16``; ``strict``: Habana's
    literal rule (its default BF16 list). Raises before anything changes."""
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
        ignored = [
            f"{titles[k]} {str(getattr(s, 'source', s))!r}" for k, s in sources.items() if k != "promote" and given(s)
        ]
        if ignored:
            warnings.warn(
                f"hmp: opt_level O2 uses its own lists; ignoring the given {' and '.join(ignored)}",
                stacklevel=state.user_stacklevel(),
            )
        sources["bf16"] = sources["fp32"] = ""
    from_user = {k: given(v) for k, v in sources.items()}
    loaded, printable = {}, {}
    for kind in KINDS:
        default = default_path(default_file(opt_level, kind, low, strict))
        source = sources[kind] if from_user[kind] else default
        loaded[kind], printable[kind] = _load_one(source, resolver, titles[kind], kind, default)
        if not from_user[kind]:  # a default list names nothing on the user's behalf
            loaded[kind] = loaded[kind]._replace(explicit=frozenset())
    ops = combine(*(loaded[k] for k in KINDS), printable)
    files = {k: from_user[k] and not isinstance(sources[k], Names) for k in KINDS}
    _warn_dropped(ops, loaded, files, printable, titles, (opt_level, low, strict), resolver)
    if from_user["bf16"] and not strict:
        pays.warn_left_to_torch(ops["bf16"], f"{titles['bf16']} {printable['bf16']!r}")
    classes = {k: loaded[k].modules for k in ("bf16", "fp32")}
    both = [c for c in classes["bf16"] if c in classes["fp32"]]
    if both:
        raise ValueError(
            f"hmp: module classes in both the BF16 list {printable['bf16']!r} and the FP32 list "
            f"{printable['fp32']!r}: {', '.join(entry_key(c) for c in both)}"
        )
    return ops, classes


# user files that leave out default ops get a warning: the FP32 list keeps
# losses and softmax out of the lower dtype, the promote list gives mixed
# inputs one dtype; a BF16 file that leaves some out only runs them in fp32
_GUARDED = ("fp32", "promote")


def _warn_dropped(ops, loaded, from_user, printable, titles, mode, resolver):
    """One warning per file for a user list that is empty, or that replaces
    a default FP32 or promote list and leaves out ops it holds. ``mode``:
    ``(opt_level, low, strict)``, which pick the defaults."""
    opt_level, low, strict = mode
    for kind in KINDS:
        if not from_user[kind]:  # a default, or a gaudi config's complete list
            continue
        entries = loaded[kind]
        if not entries.ops and not entries.modules:
            if state.first_time(("empty list", kind, printable[kind])):
                warnings.warn(
                    f"hmp: {titles[kind]} {printable[kind]!r} is empty, so the {list_title(kind, low)} list "
                    f"is empty. To extend the default list instead, start the file with "
                    f"'include default' (docs/lists.md).",
                    UserWarning,
                    stacklevel=state.user_stacklevel(),
                )
            continue
        if kind not in _GUARDED:
            continue
        default = load(default_path(default_file(opt_level, kind, low, strict)), resolver, "default list").ops
        elsewhere = set().union(*(ops[k] for k in KINDS if k != kind))
        dropped = sorted(set(default) - ops[kind] - elsewhere)
        if dropped and state.first_time(("dropped defaults", kind, printable[kind], tuple(dropped))):
            warnings.warn(
                f"hmp: {titles[kind]} {printable[kind]!r} replaces the default {list_title(kind, low)} list and "
                f"leaves out {', '.join(dropped)}: they now run in their inputs' dtypes. Start the file "
                f"with 'include default' to extend the default list instead (docs/lists.md).",
                UserWarning,
                stacklevel=state.user_stacklevel(),
            )
