"""What the command line's subcommands share: argument types (a bad value is
argparse's usage error naming the flag and the value, not a traceback), the
list-file flags, and the one-line ``PROG: error: ...`` every refusal prints
before its exit code (2: bad input, fixable by changing the command)."""

import argparse
import os
import sys
from pathlib import Path

import torch

from hmp.binding import kinds

# what hmp's own messages start with; after "PROG: error: " they say nothing more
PREFIXES = ("hmp.tune: ", "hmp.audit: ", "hmp.profile: ", "hmp.tools.report: ", "hmp: ")


def _checked(text, convert, expected, within, expected_range):
    """``convert(text)`` where that parses and ``within`` holds of it; otherwise
    a usage error saying what was expected and what was given."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not within(value):
        raise argparse.ArgumentTypeError(f"expected {expected_range}, got {value}")
    return value


def positive_int(text):
    return _checked(text, int, "a positive integer", lambda v: v > 0, "a positive integer")


def seed(text):
    """What torch.manual_seed takes."""
    return _checked(text, int, "a non-negative integer", lambda v: 0 <= v < 2**63, "an integer from 0 to 2**63-1")


def fraction(text):
    """A share strictly between 0 and 1 (0.02 is 2%)."""
    return _checked(
        text, float, "a number such as 0.02", lambda v: 0 < v < 1, "a fraction between 0 and 1 (0.02 is 2%)"
    )


def list_flags():
    """``{flag: (kind, the attribute argparse stores it under)}``: ``--<name>-file`` for each
    list kind (hmp/binding/kinds.py), read when asked, so a kind added there has its flag."""
    return {f"--{k.name}-file": (k, f"{k.name}_file") for k in kinds.KINDS}


def given_files(args):
    """``[(kind, the file its flag gave, or "")]`` for parsed ``args``."""
    return [(k, getattr(args, attr, "")) for k, attr in list_flags().values()]


def add_list_files(p, what="to run under"):
    """--bf16-file, --fp32-file, ... (list_flags) on parser ``p``."""
    for flag, (record, attr) in list_flags().items():
        kind = record.title_in(torch.bfloat16)
        env = f"${record.environ[0]}, else " if record.environ else ""
        p.add_argument(
            flag,
            dest=attr,
            default="",
            metavar="PATH",
            help=f"the {kind} list file {what}, e.g. tuned_{record.name}.txt (default: {env}the shipped list)",
        )


def said(error, prog=""):
    """What ``error`` says, once: an OSError hmp raised by its own message (not errno's repeat of
    the path), without the prefixes of hmp's messages."""
    text = error.strerror if isinstance(error, OSError) and str(error.strerror).startswith("hmp") else str(error)
    for prefix in ((f"{prog}: ",) if prog else ()) + PREFIXES:
        text = text.removeprefix(prefix)
    return text


def list_file_problem(error, args, prog=""):
    """The line for a list file hmp.convert() refused (an OSError or a ValueError it raised), led
    by the flag that gave the file when one did."""
    named = getattr(error, "filename", None)
    for flag, (_, attr) in list_flags().items():
        given = getattr(args, attr, "")
        if given and (
            (named and Path(named) == Path(given)) or repr(given) in str(error) or os.path.abspath(given) in str(error)
        ):
            return f"{flag} {given}: {said(error, prog)}"
    return said(error, prog)


def fail(prog, message, code=2):
    """``PROG: error: message`` on stderr; the exit code."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return code
