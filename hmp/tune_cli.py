"""``python -m hmp tune``: run hmp.tune on the demo's language model and
print the report (module classes proposed for FP32 included); write the
tuned list files and, with ``--plot``, draw each op's bf16 error against the
time it takes."""

import argparse
import json
import sys

import torch

from . import tuning
from .files import check_outputs
from .lists import class_path
from .demo import data as demo_data
from .demo.training import Config, build, train_step

PROG = "python -m hmp tune"


def add_parser(subparsers):
    p = subparsers.add_parser(
        "tune", help="fit the op lists to the demo model by measurement",
        description="Audit the current lists on the demo language model, move ops that hurt to FP32, "
                    "try expensive ops in bf16, validate against fp32 and write the tuned list files.")
    p.add_argument("--steps", type=int, default=20, help="validation steps per configuration (default 20)")
    p.add_argument("--batch-size", type=int, default=8, help="batch size of the tuning step (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16-out", default="tuned_bf16.txt", help="where to write the BF16 list")
    p.add_argument("--fp32-out", default="tuned_fp32.txt", help="where to write the FP32 list")
    p.add_argument("--plot", metavar="PATH", help="draw op error against fp32 time (needs matplotlib)")
    p.add_argument("--json", metavar="PATH", help="write the measurements as JSON")
    p.set_defaults(run=run)


def _fail(message):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in result.audit.rows:
        ax.scatter(row["own_max_rel"] or 1e-6, 1e-3, marker="o", color="tab:blue")
        ax.annotate(row["op"], (row["own_max_rel"] or 1e-6, 1e-3), fontsize=8)
    for op, t in result.trials.items():
        color = "tab:green" if t["accepted"] else "tab:red"
        ax.scatter(t["own_max_rel"] or 1e-6, t["seconds"] * 1e3, marker="s", color=color)
        ax.annotate(op, (t["own_max_rel"] or 1e-6, t["seconds"] * 1e3), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("own max relative error in bf16")
    ax.set_ylabel("fp32 time in the step (ms); audited ops at 1e-3")
    ax.set_yscale("log")
    ax.set_title("hmp tune: ops tried in bf16 (green kept, red not)")
    fig.tight_layout()
    fig.savefig(path)


def run(args):
    if args.steps <= 0 or args.batch_size <= 0:
        return _fail("--steps and --batch-size must be positive")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _fail('--plot needs matplotlib: pip install "torch-hmp[plot]"')
    outputs = [args.bf16_out, args.fp32_out] + [p for p in (args.plot, args.json) if p]
    try:  # before tuning, which takes minutes
        check_outputs(outputs, PROG)
    except ValueError as e:
        return _fail(str(e).removeprefix(f"{PROG}: "))
    cfg = Config(batch_size=args.batch_size, seed=args.seed)
    corpus = demo_data.load()
    model, opt, sched = build(cfg)
    x, y = next(demo_data.batches(corpus.train, cfg.batch_size, cfg.seq_len, torch.Generator().manual_seed(args.seed)))

    def step(x, y):
        return train_step(model, opt, sched, x, y, cfg)

    result = tuning.tune(step, x, y, state=(model, opt, sched), steps=args.steps)
    print(result.table())
    classes = ", ".join(map(class_path, result.modules_to_fp32))
    if classes:
        print(f"\nproposed for the FP32 list, instead of moving their ops: module classes {classes}")
    try:
        result.write(args.bf16_out, args.fp32_out)
    except (ValueError, OSError) as e:
        return _fail(str(e))
    print(f"\nwrote {args.bf16_out} and {args.fp32_out}; use them with "
          f"hmp.convert(bf16_file_path={args.bf16_out!r}, fp32_file_path={args.fp32_out!r})")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lists": result.lists, "modules_to_fp32": [class_path(c) for c in result.modules_to_fp32],
                       "validation": result.validation, "timings": result.timings, "trials": result.trials,
                       "module_proposals": result.proposals, "module_class_proposals": result.module_proposals,
                       "audit": result.audit.rows,
                       "audit_modules": result.audit.modules, "audit_module_classes": result.audit.module_classes},
                      f, indent=2, default=str)
    return 0
