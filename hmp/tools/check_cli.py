"""``python -m hmp check [BF16_FILE [FP32_FILE]]``: property-check list files
against the running torch: every entry's drawn calls run in the dtype hmp's
rules give, no call fails because of a cast, a finite value stays finite. One
verdict line per entry; exit 0 when every entry passes, 1 when one fails, 2
for bad input. The work is hmp.testing.check_lists (hmp/testing/checking.py),
which needs hypothesis; it is imported only when the command runs."""

import importlib

import torch

from hmp.binding.kinds import OPT_LEVELS
from hmp.core import dtypes
from hmp.driver.plan import PARAMETERS
from hmp.tools.arguments import fail, positive_int, said

PROG = "python -m hmp check"
LOWER = {dtypes.name(d): d for d in dtypes.LOW}  # --lower's choices


def add_parser(subparsers):
    p = subparsers.add_parser(
        "check",
        help="property-check list files against this torch: each entry runs in its list's dtype on drawn calls",
        description="Convert with the list files given (default: the environment's, else the shipped ones), then "
        "call every entry of every list on drawn inputs (edge values among them): each call must run in the dtype "
        "hmp's rules give, no call may fail that runs in plain torch, and no finite value may become inf in a cast. "
        "Prints one verdict per entry. Needs hypothesis: pip install hypothesis (or the testing extra).",
    )
    p.add_argument(
        "bf16_file", nargs="?", default="", metavar="BF16_FILE", help="the BF16 list file (default: shipped)"
    )
    p.add_argument(
        "fp32_file", nargs="?", default="", metavar="FP32_FILE", help="the FP32 list file (default: shipped)"
    )
    p.add_argument("--promote-file", default="", metavar="PATH", help="the promote list file (default: shipped)")
    level = PARAMETERS["opt_level"].default
    p.add_argument(
        "--opt-level", choices=OPT_LEVELS, default=level, help=f"the opt_level to convert with (default {level})"
    )
    p.add_argument("--strict", action="store_true", help="Habana's literal rule: every listed op casts")
    lower = dtypes.name(PARAMETERS["low_precision_type"].default)
    p.add_argument("--lower", choices=tuple(LOWER), default=lower, help=f"the lower dtype (default {lower})")
    p.add_argument("--examples", type=positive_int, default=20, help="drawn calls per entry (default 20)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="check these entries alone")
    p.add_argument("--device", default="cpu", help="where the drawn calls run (default cpu)")
    p.set_defaults(run=run)


def run(args):
    try:
        checking = importlib.import_module("hmp.testing.checking")
    except ModuleNotFoundError as e:
        if e.name != "hypothesis":
            raise
        needs = importlib.import_module("hmp.testing").NEEDS  # imported here: the command alone needs it
        return fail(PROG, f"it draws calls with hypothesis, which is not installed: {needs}")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        return fail(PROG, f"--device {args.device}: {e}")
    try:
        report = checking.check_lists(
            args.bf16_file,
            args.fp32_file,
            promote_file_path=args.promote_file,
            opt_level=args.opt_level,
            strict=args.strict,
            low_precision_type=LOWER[args.lower],
            examples=args.examples,
            only=set(args.only) if args.only else None,
            device=str(device),
        )
    except (ValueError, OSError, TypeError) as e:
        return fail(PROG, said(e, PROG))
    print(report, flush=True)
    return 0 if report.ok else 1
