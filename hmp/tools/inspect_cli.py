"""What ``python -m hmp audit`` and ``python -m hmp profile`` share: TARGET
(hmp/tools/target.py, as for tune), the list files to run under, and the
output paths, checked before anything runs."""

import contextlib
import sys

import hmp
from hmp.tools.files import check_outputs
from hmp.tools.target import HELP, TargetError, load_target, make_target


def add_common(p):
    """TARGET, --bf16-file/--fp32-file and --report on parser ``p``."""
    p.add_argument("target", metavar="TARGET", help=HELP)
    p.add_argument(
        "--bf16-file",
        default="",
        metavar="PATH",
        help="the BF16 list file to run under, e.g. tuned_bf16.txt (default: $LOWER_LIST, else the shipped list)",
    )
    p.add_argument(
        "--fp32-file",
        default="",
        metavar="PATH",
        help="the FP32 list file to run under, e.g. tuned_fp32.txt (default: $FP32_LIST, else the shipped list)",
    )
    p.add_argument("--report", metavar="PATH", help="write the result as one self-contained HTML page")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")


def fail(prog, message, code=2):
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code


@contextlib.contextmanager
def prepared(args, prog):
    """``(step, state)`` of TARGET with hmp converted to the lists given,
    for the block; the configuration before it comes back after. A bad
    output path or list file is a ValueError, a bad TARGET a TargetError."""
    check_outputs([p for p in (args.report, args.json) if p], prog)
    step, state = make_target(load_target(args.target), args.target)
    with hmp.converted(bf16_file_path=args.bf16_file, fp32_file_path=args.fp32_file):
        yield step, state


def run(args, prog, measure, save_html, to_json):
    """Measure TARGET (``measure(step, state)`` -> a report), print its
    table, write ``--report`` and ``--json``; the exit code."""
    try:
        with prepared(args, prog) as (step, state):
            report = measure(step, state)
    except TargetError as e:
        return fail(prog, str(e))
    except ValueError as e:  # an output path or a list file
        return fail(prog, str(e).removeprefix(f"{prog}: "))
    print(report.table())
    for path, write in ((args.report, save_html), (args.json, to_json)):
        if path:
            try:
                write(report, path)
            except (ValueError, OSError) as e:
                return fail(prog, str(e), 1)
            print(f"wrote {path}")
    return 0
