"""``python -m hmp profile TARGET``: hmp.profile on your own training step
(TARGET as for tune, hmp/tools/target.py): per listed op, the dtypes it got
and ran in, its calls, time and casts, printed as a table; ``--report``
writes it as HTML."""

import inspect

from hmp.tools import inspect_cli
from hmp.tools.profiling import profile
from hmp.tools.target import add_command

PROG = "python -m hmp profile"
REPEATS = inspect.signature(profile).parameters["repeats"].default  # the recorded runs, after one warm-up


def add_parser(subparsers):
    p = add_command(
        subparsers,
        "profile",
        f"run your training step {REPEATS + 1} times under the lists: per op, the dtypes, calls, time and casts",
        f"Run TARGET's training step {REPEATS + 1} times under the lists, each from the same state: once to warm "
        f"up, then {REPEATS} times with instrumented wrappers, and report, per listed op, the dtypes its inputs "
        "came in and it ran in, its calls (from the first recorded run), its median time over the recorded runs "
        "and what casting cost.",
        " (put back afterwards).",
    )
    inspect_cli.add_common(p)
    p.set_defaults(run=run)


def run(args):
    return inspect_cli.run(
        args,
        PROG,
        lambda step, state, progress: profile(step, state=state, progress=progress),
        lambda report, path: report.save_html(path),
        lambda report, path: report.save(path),
    )
