"""What ``python -m hmp audit``, ``profile`` and ``tune`` share: TARGET
(hmp/tools/target.py), the list files to run under, and the output paths,
all checked before anything runs; each problem is one line and exit 2."""

import os

import torch

from hmp.binding.list_files import list_path
from hmp.driver.conversion import converted
from hmp.tools.arguments import add_list_files, fail, given_files, list_file_problem, said
from hmp.tools.files import check_outputs
from hmp.tools.progress import bar as progress_bar
from hmp.tools.target import HELP, TargetError, load_target, make_target


def add_common(p):
    """TARGET, --bf16-file/--fp32-file/..., --report and --json on parser ``p``."""
    p.add_argument("target", metavar="TARGET", help=HELP)
    add_list_files(p)
    p.add_argument("--report", metavar="PATH", help="write the result as one self-contained HTML page")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")


def lists(args):
    """The convert() arguments of the list-file flags given (one not given is convert()'s default)."""
    return {kind.parameter: given for kind, given in given_files(args) if given}


def lists_words(args, environ=None):
    """Which list files the command runs under, as convert() finds them: the flag's file, else the
    environment's (``$LOWER_LIST``, ...), else hmp's default (O1, bfloat16)."""
    environ = os.environ if environ is None else environ
    said = []
    for kind, given in given_files(args):
        var = next((v for v in kind.environ if environ.get(v)), None)
        where = given or (f"{environ[var]} (from ${var})" if var else f"hmp's default, {list_path(kind.name)}")
        said.append(f"the {kind.title_in(torch.bfloat16)} list {where}")
    return "ran under " + " and ".join(said)


def check_lists(args, prog):
    """None when the list files given (or in the environment) load, else the one line that says
    why; nothing stays converted."""
    try:
        with converted(**lists(args)):
            pass
    except (ValueError, OSError, TypeError) as e:
        return list_file_problem(e, args, prog)
    return None


def prepare(args, prog):
    """``(step, state)`` of TARGET, or the exit code after one line saying what is wrong: an
    output path, a list file (both checked first: the target may take long to build) or TARGET."""
    try:
        check_outputs([p for p in (args.report, args.json) if p], prog)
    except ValueError as e:
        return fail(prog, said(e, prog))
    problem = check_lists(args, prog)
    if problem:
        return fail(prog, problem)
    try:
        return make_target(load_target(args.target), args.target)
    except TargetError as e:
        return fail(prog, str(e))


def run(args, prog, measure, save_html, to_json):
    """Measure TARGET (``measure(step, state, progress)`` -> a report) under
    the lists given, its runs shown on stderr, print its table, write
    ``--report`` and ``--json``; the exit code."""
    target = prepare(args, prog)
    if isinstance(target, int):
        return target
    shown, progress = progress_bar("measuring", prog)
    report = None
    try:
        with converted(**lists(args)):
            report = measure(*target, progress)
    finally:
        shown.close(None if report is None else f"measured in {shown.elapsed():.0f} s ({shown.done} runs of the step)")
    print(lists_words(args))
    print(report.table())
    for path, write in ((args.report, save_html), (args.json, to_json)):
        if path:
            try:
                write(report, path)
            except (ValueError, OSError) as e:
                return fail(prog, said(e, prog), 1)
            print(f"wrote {path}")
    return 0
