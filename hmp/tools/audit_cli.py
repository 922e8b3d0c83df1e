"""``python -m hmp audit TARGET``: hmp.audit on your own training step
(TARGET as for tune, hmp/tools/target.py): each listed op's and module's
bf16 error against fp32, printed as tables; ``--report`` draws it as HTML."""

import json
from pathlib import Path

from hmp.tools import inspect_cli
from hmp.tools.arguments import fraction
from hmp.tools.auditing import audit
from hmp.tools.target import add_command

PROG = "python -m hmp audit"


def add_parser(subparsers):
    p = add_command(
        subparsers,
        "audit",
        "measure where the lists' lower dtype hurts your model: each op's and module's error against fp32",
        "Run TARGET's training step in fp32 and under the lists from the same state, pair each listed op's and "
        "module's outputs, and flag those whose own error or the error they pass to the loss is too large.",
        " (put back after each run).",
    )
    inspect_cli.add_common(p)
    p.add_argument(
        "--threshold",
        type=fraction,
        default=0.05,
        help="flag an op whose own error exceeds this, relative (default 0.05)",
    )
    p.add_argument(
        "--loss-threshold",
        type=fraction,
        default=2e-3,
        help="flag an op whose error alone moves the loss by more than this, relative (default 0.002)",
    )
    p.set_defaults(run=run)


def _json(report, path):
    data = {
        "output_error": report.output_error,
        "flagged": report.flagged,
        "flagged_modules": report.flagged_modules,
        "ops": report.rows,
        "modules": report.modules,
        "module_classes": report.module_classes,
    }
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


def run(args):
    def measure(step, state, progress):
        return audit(step, state=state, threshold=args.threshold, loss_threshold=args.loss_threshold, progress=progress)

    return inspect_cli.run(args, PROG, measure, lambda report, path: report.save_html(path), _json)
