"""Op list files: reading, validating and combining them into effective lists.

Runs before anything is patched, so a bad file raises with torch untouched. Each
kind's record (kinds.py) says where its file comes from. Besides op names and module
paths a line may be ``include default``, ``include <name>`` (a shipped list) or
``-name`` (take it out), so a file can extend a default list. Names of ops that only
alias, copy, move or write data are skipped with a warning (refusals.py)."""

import functools
import logging
import os
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from hmp.binding import kinds, pays, refusals
from hmp.binding.kinds import FP32, LOWER
from hmp.binding.list_files import (
    SANE,
    SHOWN,
    check_path,
    default_path,
    error_text,
    list_dir,
    list_path,
    names,
    read_lines,
    short,
)
from hmp.binding.module_entries import entry_key, from_line, is_module_path, is_pattern
from hmp.binding.refusals import refusal
from hmp.binding.resolve import BOUND, NO_PYTHON, UNKNOWN
from hmp.core import state

log = logging.getLogger("hmp")

FP16_FILE_TITLE = "FP16 list file"  # the lower list's file under float16 (fp16_file_path, Habana's name)


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


# kept: a memo of what torch or a shipped file says, the same for every call, never written by one
@functools.lru_cache(maxsize=None)
def fallback_names(low):
    """``((FP32, names), (PROMOTE, names))`` (kinds.Kind records): the ops that get
    the FP32 rule (no kernel for ``low``) and the promote rule (they need one
    dtype) when they are in no list. Shipped and checked by the test suite,
    so read without checking each name again."""
    return (
        (FP32, tuple(names(default_path(NO_KERNEL_FILES[low])))),
        (kinds.PROMOTE, tuple(sorted(one_dtype_names()))),
    )


# kept: a memo of what torch or a shipped file says, the same for every call, never written by one
@functools.lru_cache(maxsize=None)
def one_dtype_names():
    """The ops that need all their floating inputs in one dtype (op_lists/one_dtype.txt):
    the only ones whose promotion torch does not do itself."""
    return frozenset(names(default_path(ONE_DTYPE_FILE)))


class Entries(NamedTuple):
    """What one list holds: op names and module classes, in file order;
    ``explicit``: the op names the file itself names (not through ``include``)."""

    ops: list
    modules: list
    explicit: frozenset = frozenset()


def load(path, known, what, modules=True, default=None):
    """Read a list file and check every name with ``known.check(name)``; a module class's
    path is imported (the only code a list file can run). ``modules=False``: module
    entries are an error. ``default``: what ``include default`` reads.

    Returns Entries: op names in file order, deduplicated, an overload as its op, and the
    classes. An aten operator no Python name reaches is left out with one warning; bad
    lines raise one ValueError naming the file and every line."""
    lines, syntax = read_lines(path, what)
    r = _Reading(path, known, what)
    for line in lines:
        number, name, remove = line.number, line.name, line.remove
        if line.include:
            r.include(number, name, modules, default)
            continue
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
        self.removals = {}  # line number -> the name its '-name' line takes out, as written

    def include(self, number, included, modules, default):
        try:
            source = default if included == "default" else list_path(included)
            if source is None:
                raise ValueError("no default list here")
            included = load(source, self.known, f"list {included!r}", modules)
        except ValueError as e:
            self.errors.append((number, f"line {number}: 'include {included}': {str(e).replace('hmp: ', '')}"))
            return
        for op in included.ops:
            self.names.setdefault(op, number)
        for entry in included.modules:
            self.classes.setdefault(entry_key(entry), entry)

    def module_line(self, number, name, remove, modules):
        try:
            if not modules:
                raise ValueError(f"{name!r}: module entries go in the BF16 or FP32 list")
            # a '-' line imports nothing: a library not installed (or not imported yet) is taken out
            # as a pattern, as a shipped list names it (tune writes such lines for every shipped entry)
            entry = from_line(name, _shipped(self.path) or remove)
            if remove:  # as written (how an included pattern is known) and as the class it names
                self.removed[name] = self.removed[entry_key(entry)] = number
                self.removals[number] = name
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
            self.removals[number] = name
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
        took = {removed[op] for op in names if op in removed}
        took |= {removed[k] for key, e in self.classes.items() for k in (key, entry_key(e)) if k in removed}
        inert = [f"line {n}: '-{name}'" for n, name in sorted(self.removals.items()) if n not in took]
        if inert:
            warn_takes_out_nothing(f"{what} {str(path)!r}: {'; '.join(inert)}", len(inert))
        return Entries(ops, list(dict.fromkeys(found)), frozenset(explicit))


def replaces_default(source):
    """True for a list the user gives whole: names (a config's complete list), or a file with no
    ``include default`` line (an include of another shipped list is part of its own text)."""
    if isinstance(source, Names):
        return True
    lines, _ = read_lines(source, "list file")
    return not any(line.include and line.name == "default" for line in lines)


def _shipped(path):
    """True for a file among the shipped lists."""
    return Path(os.fspath(path)).resolve().parent == list_dir().resolve()


def how_to_add(name, kind, low=None):
    """Advice that keeps the default list: how to put ``name`` in ``kind``'s list (a kinds.Kind)."""
    return (
        f"put '{name}' in a file whose first line is 'include default' and pass it as {kind.parameter}, so the "
        f"default {kind.title_in(low)} list stays in force"
    )


def warn_unreachable(where):
    """The one warning for real aten operators that hmp cannot bind."""
    warnings.warn(
        f"hmp: {where}: nothing to bind in Python; calls reach it from C++, so hmp skips it "
        f"(list the Python-level op that calls it instead, such as conv2d for convolutions)",
        UserWarning,
        stacklevel=state.user_stacklevel(),
    )


def warn_takes_out_nothing(where, count=1):
    """The one warning for a file's '-name' lines that take nothing out: the list they are in holds
    no such entry (a typo, or the entry is in another list)."""
    warnings.warn(
        f"hmp: {where}: {'takes' if count == 1 else 'each take'} out nothing: this file's list holds no "
        f"such entry, so {'the line changes' if count == 1 else 'the lines change'} nothing. A '-name' "
        f"line takes out an entry its own file holds (through 'include'); to take an op out of another "
        f"list, put the '-name' line in that list's file (hmp.effective_lists() shows which list holds it)",
        UserWarning,
        stacklevel=state.user_stacklevel(),
    )


def combine(loaded, sources):
    """Apply the precedence rules to each kind's Entries (``loaded``, by kinds.Kind) and return
    kind -> set of op names. An op a file names itself wins over the same op included in the
    other list; named or included in both is an error. The lower and FP32 lists win over
    the others (the promote list); among those an op goes to the list whose file names it,
    else to the first in the kinds' order that holds it."""
    lower, fp32 = loaded[LOWER], loaded[FP32]
    low, high = set(lower.ops), set(fp32.ops)
    both = low & high
    clash = sorted(op for op in both if (op in lower.explicit) == (op in fp32.explicit))
    if clash:
        raise ValueError(
            f"hmp: ops in both the BF16 list {sources[LOWER]!r} and the FP32 list {sources[FP32]!r}: {', '.join(clash)}"
        )
    to_lower = sorted(op for op in both if op in lower.explicit)
    to_fp32 = sorted(op for op in both if op in fp32.explicit)
    if to_lower:
        log.info("hmp: BF16 list %s takes %s out of the FP32 list", sources[LOWER], ", ".join(to_lower))
    if to_fp32:
        log.info("hmp: FP32 list %s takes %s out of the BF16 list", sources[FP32], ", ".join(to_fp32))
    high -= set(to_lower)
    low -= set(to_fp32)
    out = {LOWER: low, FP32: high}
    rest = [k for k in kinds.KINDS if k not in out]
    taken = low | high
    for k in rest:
        named_elsewhere = set().union(*(loaded[o].explicit for o in rest if o is not k)) - loaded[k].explicit
        out[k] = set(loaded[k].ops) - taken - named_elsewhere
        taken |= out[k]
    return {k: out[k] for k in kinds.KINDS}


def given(path):
    """True for a path or names the caller gave; ``""`` and None mean "not given"."""
    return path is not None and not (isinstance(path, str) and path == "")


def _env_path(kind, environ):
    for var in kind.environ:
        value = environ.get(var, "")
        if value:
            return value, var
    return "", None


def _low_list(lower, fp16, low):
    """``(source, title)`` of the lower-precision list, as Habana's HMP chose
    it: ``fp16_file_path`` is that list when the lower dtype is float16 and
    is ignored (with a warning) under bfloat16. hmp also lets
    bf16_file_path name it under float16 when no fp16_file_path is given."""
    if not given(fp16):
        return lower, LOWER.file_title
    if low != torch.float16:
        warnings.warn(
            f"hmp: fp16_file_path {fp16!r} is ignored: it names the list for "
            f"low_precision_type=torch.float16, and the lower dtype is {low}",
            stacklevel=state.user_stacklevel(),
        )
        return lower, LOWER.file_title
    if given(lower):
        warnings.warn(
            f"hmp: {LOWER.parameter} {lower!r} is ignored: with low_precision_type=torch.float16 "
            f"the lower-precision list is fp16_file_path {fp16!r}",
            stacklevel=state.user_stacklevel(),
        )
    return fp16, FP16_FILE_TITLE


def _load_one(source, resolver, title, kind, default):
    """``(Entries, printable source)`` for one list: a path or Names."""
    if isinstance(source, Names):
        return Entries(list(source.names), [], frozenset(source.names)), source.source
    printable = os.fspath(source) if isinstance(source, (str, os.PathLike)) else source
    return load(source, resolver, title, modules=kind.takes_modules, default=default), printable


def effective(
    resolver, opt_level="O1", sources=None, *, fp16="", low=torch.bfloat16, strict=False, environ=None, replacing=None
):
    """Read, validate and combine the lists: ``(kind -> op names, kind -> module classes)``,
    by kinds.Kind. ``sources``: kind -> a path, a Names, or ``""``/None for the
    environment's list, else the shipped default. ``fp16``: the lower list under
    ``low=torch.float16``; ``strict``: Habana's literal rule. ``replacing``: a set given gets the
    kinds whose list the user's source gives whole (replaces_default). Raises before anything changes."""
    environ = os.environ if environ is None else environ
    sources = {k: (sources or {}).get(k, "") for k in kinds.KINDS}
    titles = {k: k.file_title for k in kinds.KINDS}
    sources[LOWER], titles[LOWER] = _low_list(sources[LOWER], fp16, low)
    for k in kinds.KINDS:
        if k.environ and not given(sources[k]):
            sources[k], var = _env_path(k, environ)
            if var:
                titles[k] = f"{k.file_title} (from ${var})"
                log.info("hmp: %s list from $%s: %s", k.name, var, sources[k])
    own = [k for k in kinds.KINDS if opt_level in k.own_under]
    ignored = [f"{titles[n]} {str(getattr(sources[n], 'source', sources[n]))!r}" for n in own if given(sources[n])]
    if ignored:
        warnings.warn(
            f"hmp: opt_level {opt_level} uses its own lists; ignoring the given {' and '.join(ignored)}",
            stacklevel=state.user_stacklevel(),
        )
    for n in own:
        sources[n] = ""
    from_user = {k: given(v) for k, v in sources.items()}
    loaded, printable = {}, {}
    for k in kinds.KINDS:
        default = default_path(k.default_file(opt_level, low, strict))
        source = sources[k] if from_user[k] else default
        loaded[k], printable[k] = _load_one(source, resolver, titles[k], k, default)
        if not from_user[k]:  # a default list names nothing on the user's behalf
            loaded[k] = loaded[k]._replace(explicit=frozenset())
    ops = combine(loaded, printable)
    if replacing is not None:
        replacing.update(k for k in kinds.KINDS if from_user[k] and replaces_default(sources[k]))
    files = {k: from_user[k] and not isinstance(sources[k], Names) for k in sources}
    _warn_dropped(ops, loaded, files, printable, titles, (opt_level, low, strict), resolver)
    if from_user[LOWER] and not strict:
        pays.warn_left_to_torch(ops[LOWER], f"{titles[LOWER]} {printable[LOWER]!r}")
    classes = {k: loaded[k].modules for k in kinds.KINDS if k.takes_modules}
    both = [c for c in classes[LOWER] if c in classes[FP32]]
    if both:
        raise ValueError(
            f"hmp: module classes in both the BF16 list {printable[LOWER]!r} and the FP32 list "
            f"{printable[FP32]!r}: {', '.join(entry_key(c) for c in both)}"
        )
    return ops, classes


def _warn_dropped(ops, loaded, from_user, printable, titles, mode, resolver):
    """One warning per file for a user list that is empty, or that replaces
    a default FP32 or promote list and leaves out ops it holds. ``mode``:
    ``(opt_level, low, strict)``, which pick the defaults."""
    opt_level, low, strict = mode
    for k in kinds.KINDS:
        if not from_user[k]:  # a default, or a gaudi config's complete list
            continue
        entries = loaded[k]
        if not entries.ops and not entries.modules:
            if state.first_time(("empty list", k.name, printable[k])):
                warnings.warn(
                    f"hmp: {titles[k]} {printable[k]!r} is empty, so the {k.title_in(low)} list "
                    f"is empty. To extend the default list instead, start the file with "
                    f"'include default' (docs/lists.md).",
                    UserWarning,
                    stacklevel=state.user_stacklevel(),
                )
            continue
        if not k.guards_defaults:
            continue
        default = load(default_path(k.default_file(opt_level, low, strict)), resolver, "default list").ops
        elsewhere = set().union(*(ops[n] for n in ops if n is not k))
        dropped = sorted(set(default) - ops[k] - elsewhere)
        if dropped and state.first_time(("dropped defaults", k.name, printable[k])):  # one short line per file
            warnings.warn(
                f"hmp: {titles[k]} {printable[k]!r} replaces the default {k.title_in(low)} list and leaves out "
                f"{len(dropped)} of its {len(default)} ops, which now run in their inputs' dtypes (compare "
                f"hmp.effective_lists()[{k.name!r}] with hmp.list_path({k.name!r})); 'include default' as the "
                "file's first line keeps them (docs/lists.md).",
                UserWarning,
                stacklevel=state.user_stacklevel(),
            )
