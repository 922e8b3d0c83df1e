"""``python -m hmp tune [TARGET]``: run hmp.tune on your own training step
(TARGET, ``my_module:make_step`` or ``path/to/file.py:make_step``) or, with
no TARGET, on the demo's language model; print the report with a verdict,
write the tuned list files and, with ``--report``, an HTML picture.

TARGET names a function that takes no arguments and returns ``(step,
state)``: ``step()`` runs one training step and returns its loss, ``state``
is a tuple of the modules, optimizers and schedulers the step changes
(hmp.tune puts them back as they were after each trial)."""

import importlib
import json

import torch

from hmp.binding import kinds
from hmp.binding.module_entries import class_path
from hmp.driver.conversion import converted
from hmp.tools import inspect_cli, tuning
from hmp.tools.arguments import add_list_files, fail, fraction, positive_int, said, seed
from hmp.tools.files import check_outputs
from hmp.tools.progress import bar as progress_bar
from hmp.tools.target import TargetError, add_command, load_target, make_target

PROG = "python -m hmp tune"
# The default TARGET, imported by name only when no TARGET is given (as __main__ loads a
# subcommand): the demo is a step like a user's, and no import of the tools.
DEMO = "hmp.demo.training:make_step"


def add_parser(subparsers):
    p = add_command(
        subparsers,
        "tune",
        "fit the op lists to your model (or the demo's) by measurement",
        "Audit the current lists on a training step, move ops that hurt to FP32, try expensive ops in bf16, "
        "validate against fp32 and write the tuned list files.",
        ". Without TARGET, the demo's language model is tuned.",
    )
    p.add_argument(
        "target",
        nargs="?",
        metavar="TARGET",
        help="MODULE:FUNCTION or FILE.py:FUNCTION returning (step, state) (default: the demo model)",
    )
    for flag, kind, default, text in (
        ("--steps", positive_int, 20, "validation steps per configuration (default 20)"),
        ("--rounds", positive_int, 5, "timing rounds, configurations interleaved (default 5; more narrows the spread)"),
        ("--tolerance", fraction, 0.02, "how far the tuned lists' final loss may be from fp32's (default 0.02, 2%%)"),
        ("--batch-size", positive_int, 8, "the demo model's batch size (default 8)"),
        ("--seed", seed, 0, "torch.manual_seed before the model is built and the batch drawn (default 0)"),
    ):
        p.add_argument(flag, type=kind, default=default, help=text)
    add_list_files(p, "to start from")
    p.add_argument("--bf16-out", default="tuned_bf16.txt", help="where to write the BF16 list (default tuned_bf16.txt)")
    p.add_argument("--fp32-out", default="tuned_fp32.txt", help="where to write the FP32 list (default tuned_fp32.txt)")
    p.add_argument(
        "--report",
        metavar="PATH",
        help="write an HTML report: each op's and module's bf16 error and the time it saves, against the thresholds",
    )
    p.add_argument("--json", metavar="PATH", help="write the measurements as JSON")
    p.add_argument(
        "--override-fp32",
        action="store_true",
        help="also try in bf16 the ops whose input the model computes in float32 on purpose (.float() before them)",
    )
    p.set_defaults(run=run)


def _demo_target(args):
    module, _, name = DEMO.partition(":")
    return getattr(importlib.import_module(module), name)(batch_size=args.batch_size, seed=args.seed)


def run(args):
    outputs = [args.bf16_out, args.fp32_out] + [p for p in (args.report, args.json) if p]
    try:  # before tuning, which takes minutes
        check_outputs(outputs, PROG)
    except ValueError as e:
        return fail(PROG, said(e, PROG))
    problem = inspect_cli.check_lists(args, PROG)
    if problem:
        return fail(PROG, problem)
    torch.manual_seed(args.seed)
    try:
        step, state = make_target(load_target(args.target), args.target) if args.target else _demo_target(args)
    except TargetError as e:
        return fail(PROG, str(e))
    bar, report = progress_bar("tuning", PROG)
    result = None
    try:
        with converted(**inspect_cli.lists(args)):
            result = tuning.tune(
                step,
                state=state,
                steps=args.steps,
                rounds=args.rounds,
                tolerance=args.tolerance,
                override_fp32=args.override_fp32,
                progress=report,
            )
    except tuning.StepDoesNotTrain as e:
        where = f"TARGET {args.target!r}" if args.target else "the demo model"
        return fail(PROG, f"{where}: {said(e)}", 1)
    finally:
        bar.close(None if result is None else f"tuned in {bar.elapsed():.0f} s ({result.runs} runs of the step)")
    print(inspect_cli.lists_words(args))
    print(result.table())
    classes = ", ".join(result.class_names())
    if classes:
        print(f"\nproposed for the FP32 list, instead of moving their ops: module classes {classes}")
    try:
        result.write(args.bf16_out, args.fp32_out)
    except (ValueError, OSError) as e:
        return fail(PROG, said(e))
    wrote = {kinds.LOWER.parameter: args.bf16_out, kinds.FP32.parameter: args.fp32_out}
    # a list tune does not write (--promote-file) stays the file it started from
    use = {**wrote, **{k: v for k, v in inspect_cli.lists(args).items() if k not in wrote}}
    print(
        f"\nwrote {args.bf16_out} and {args.fp32_out}; use them with "
        f"hmp.convert({', '.join(f'{k}={v!r}' for k, v in use.items())})"
    )
    if args.report:
        try:
            result.save_html(args.report)
        except (ValueError, OSError) as e:
            return fail(PROG, said(e), 1)
        print(f"wrote {args.report}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "lists": result.lists,
                    "modules_to_fp32": [class_path(c) for c in result.modules_to_fp32],
                    "validation": result.validation,
                    "loss_per_step": result.trajectories,  # what the verdict's loss interval is judged on
                    "timings": result.timings,
                    "step_times": result.samples,
                    "same_as": result.same_as,
                    "verdict": result.verdict,
                    "trials": result.trials,
                    "not_tried_author_fp32": result.authored,
                    "module_proposals": result.proposals,
                    "module_class_proposals": result.module_proposals,
                    "audit": result.audit.rows,
                    "audit_modules": result.audit.modules,
                    "audit_module_classes": result.audit.module_classes,
                },
                f,
                indent=2,
                default=str,
            )
    return 0
