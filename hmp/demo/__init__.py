"""``python -m hmp demo``: train a small character-level transformer on the
Python standard library's own source, in fp32 and then under hmp, and print
how fast each trained and how well each learned.

The pieces are importable: ``data`` (stdlib text to character ids),
``model`` (the transformer), ``training`` (one training run, measured; its
cast count per op comes from ``hmp.profile``), ``sizing`` (the model per
device kind, the steps that fit) and ``report`` (the results and their
table). This module is only the command line: arguments, what it says as it
goes, and the JSON file.
"""

import argparse
import dataclasses
import json
import os
import sys

import hmp
from hmp.binding.kinds import OPT_LEVELS
from hmp.demo import data as data_mod
from hmp.demo import report, sizing
from hmp.demo.training import (
    BLOCK,
    CAST_STEPS,
    MEMORY_STEPS,
    Config,
    DeviceError,
    count_casts,
    matmul_time_vs_fp32,
    model_summary,
    peak_rss_growth,
    resolve_device,
    train_interleaved,
)
from hmp.driver.plan import PARAMETERS
from hmp.tools import speed
from hmp.tools.arguments import list_file_problem, positive_int, seed
from hmp.tools.progress import Progress

PROG = "python -m hmp demo"
DEFAULTS = Config()
STEPS = 120  # the most steps a default (sized) run trains
LONG_STEPS = DEFAULTS.steps
# seconds both configurations' training aim to take together in a default run, from a step measured on
# the machine it runs on; the model never changes with it, only the number of steps
BUDGET_S = 40.0
SIZING_STEPS = 3  # timed steps per configuration (after one warm-up) that size the run
# seconds between progress lines when stderr is no terminal (a log, CI)
LINE_EVERY_S = 10.0


def _seconds(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value < 60:
        raise argparse.ArgumentTypeError(f"expected seconds from 0 to 60, got {value}")
    return value


def add_parser(subparsers):
    p = subparsers.add_parser(
        "demo",
        help="train a small transformer on the stdlib's source, fp32 vs hmp",
        description="Train the same character-level transformer language model twice from the same seed, "
        "on the Python standard library's source files: in fp32 and under hmp.convert(), a few steps of each in "
        "turn (interleaved, so load on this machine falls on both alike). "
        "Prints speed (where this machine lets it be measured: a busy one is said to be), memory, losses and "
        "hmp's casts per op. The model is the same on every run on a "
        "kind of device (a larger one on a GPU); only the number of steps follows this machine's speed.",
    )
    length = p.add_mutually_exclusive_group()
    length.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help=f"training steps per configuration (default: as many as fit about {BUDGET_S:.0f} s of training "
        f"on this machine, measured before training, from {sizing.MIN_STEPS} to {STEPS})",
    )
    length.add_argument(
        "--long",
        dest="steps",
        action="store_const",
        const=LONG_STEPS,
        help=f"a longer run: {LONG_STEPS} steps per configuration (minutes)",
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help=f"sequences per step (default {sizing.CPU_MODEL['batch_size']} on a CPU, "
        f"{sizing.ACCELERATOR_MODEL['batch_size']} on a GPU)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda", "hpu"),
        default="auto",
        help="auto: cuda if available, then hpu when habana_frameworks is installed, else cpu",
    )
    level = PARAMETERS["opt_level"].default  # convert()'s, from its signature
    p.add_argument("--opt-level", choices=OPT_LEVELS, default=level, help=f"hmp opt_level (default {level})")
    p.add_argument("--bf16-file", default="", metavar="PATH", help="hmp BF16 list file (default: hmp's own)")
    p.add_argument("--fp32-file", default="", metavar="PATH", help="hmp FP32 list file (default: hmp's own)")
    p.add_argument("--seed", type=seed, default=DEFAULTS.seed, help=f"random seed (default {DEFAULTS.seed})")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument(
        "--dry-run", action="store_true", help="say the model, what to expect and the run's length, then stop"
    )
    # a test knob: seconds added to every training step, a slower machine without loading this one
    p.add_argument("--step-delay", type=_seconds, default=0.0, help=argparse.SUPPRESS)
    p.set_defaults(run=run)
    return p


class _Progress:
    """The interleaved training of the configurations ``labels``, shown by hmp.tools.progress."""

    def __init__(self, labels, steps):
        self.labels = labels
        title = f"training {' and '.join(labels)}" + (f", {BLOCK} steps of each in turn" if len(labels) > 1 else "")
        self.progress = Progress(title, steps * len(labels), PROG, every_s=LINE_EVERY_S)

    def __call__(self, i, step, loss):
        self.progress.step(f"{self.labels[i]} loss {loss:.3f}")

    def close(self, results=None):
        if results is None:
            self.progress.close()
            return
        said = ", ".join(f"{label} val loss {r['val_loss']:.4f}" for label, r in zip(self.labels, results))
        self.progress.close(f"trained in {self.progress.elapsed():.1f} s: {said}")


def _note(msg):
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def _error(msg, code=2):
    print(f"{PROG}: error: {msg}", file=sys.stderr, flush=True)
    return code


def _hmp_options(args):
    options = {"opt_level": args.opt_level}
    if args.opt_level == "O1":  # O2 has its own lists and ignores these
        options.update(bf16_file_path=args.bf16_file, fp32_file_path=args.fp32_file)
    elif args.bf16_file or args.fp32_file:
        pairs = (("--bf16-file", args.bf16_file), ("--fp32-file", args.fp32_file))
        ignored = " and ".join(f"{flag} {path}" for flag, path in pairs if path)
        _note(f"warning: --opt-level O2 uses hmp's O2 lists; ignoring {ignored}")
    return options


def _check_hmp_options(options, args):
    """Convert once and revert, so a bad list file fails before any training."""
    try:
        with hmp.converted(**options):
            pass
    except (OSError, ValueError, TypeError) as e:
        return list_file_problem(e, args, PROG)
    return None


def _setup(args):
    """``(device, hmp options, corpus)``, or an exit code after saying what is wrong."""
    if args.json:
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            return _error(f"--json {args.json}: directory {parent!r} does not exist")
    try:
        device = resolve_device(args.device)
    except DeviceError as e:
        return _error(str(e))
    options = _hmp_options(args)
    problem = _check_hmp_options(options, args)
    if problem:
        return _error(problem)
    try:
        corpus = data_mod.load()
    except data_mod.DataError as e:
        return _error(str(e), 1)
    return device, options, corpus


DEVICE_NAMES = {"cpu": "CPU", "cuda": "CUDA GPU", "hpu": "Gaudi HPU"}


def _model_line(cfg, params, batch_chosen):
    kind = DEVICE_NAMES.get(cfg.device, cfg.device)
    why = "" if cfg.device == "cpu" else f", larger than the CPU's: a small model is launch-bound on a {kind}"
    return (
        f"model: a character-level transformer LM, {report.describe_model(dict(vars(cfg), params=params))}; "
        f"every run on a {kind} trains this model{' (the batch size is yours)' if batch_chosen else ''}{why}"
    )


def _plan(args, device, options):
    """The Config to train and what was measured to choose it, each said in a line."""
    fields = sizing.model_for(device)
    if args.batch_size:
        fields["batch_size"] = args.batch_size
    cfg = Config(steps=args.steps or STEPS, seed=args.seed, device=device, step_delay_s=args.step_delay, **fields)
    params = model_summary(cfg)
    _note(_model_line(cfg, params, args.batch_size is not None))  # the first line names the model
    ratio = matmul_time_vs_fp32(cfg)
    native = sizing.native_bf16(device)
    _note(f"this {device}: {speed.expectation(ratio, native, device)}")
    facts = {
        "params": params,
        "opt_level": args.opt_level,
        "bf16_matmul_time_vs_fp32": ratio.median if ratio is not None else None,
        "bf16_matmul_ratio": ratio.as_dict() if ratio is not None else None,  # the pairs' judgement (timing.Ratio)
        "native_bf16": native[0],
        "native_bf16_why": native[1],
        "measured_step_s": None,
        "planned_training_s": None,
    }
    if args.steps is None:
        cfg = _sized(cfg, options, facts)
    return cfg, facts


def _sized(cfg, options, facts):
    """``cfg`` with the steps that fit BUDGET_S here, from a measured step of each configuration."""
    _note(f"timing {SIZING_STEPS + 1} training steps of each configuration to size the run")
    fp32_s, hmp_s = sizing.step_seconds(cfg, [None, options], steps=SIZING_STEPS)
    budget = sizing.plan_steps(fp32_s + hmp_s, BUDGET_S, STEPS)
    over = (
        f" (over the {BUDGET_S:.0f} s aimed at: the model stays the same on every run, so a slow machine trains longer)"
        if budget.over_budget
        else ""
    )
    _note(
        f"sized to this machine: {speed.step_seconds_words(fp32_s, hmp_s)}; {budget.steps} steps per configuration, "
        f"about {budget.seconds:.0f} s of training for both{over}, more or less as this machine's load changes "
        "(the time left is updated as it trains); "
        "--steps N or --long to choose"
    )
    facts["measured_step_s"] = {"fp32": fp32_s, "hmp": hmp_s}
    facts["planned_training_s"] = budget.seconds
    return dataclasses.replace(cfg, steps=budget.steps)


def _train_both(cfg, corpus, options, opt_level):
    """fp32 and hmp from the same seed, interleaved (training.train_interleaved), with their progress."""
    labels = ["fp32", f"hmp {opt_level} (bfloat16)"]
    progress = _Progress(labels, cfg.steps)
    runs = None
    try:
        runs = train_interleaved(cfg, corpus, [None, options], on_step=progress)
    finally:
        progress.close(runs)
    for label, opts, result in zip(labels, (None, options), runs):
        result["configuration"] = label
        result["hmp"] = opts
    return runs


def _measure_memory(cfg, runs):
    """Each configuration's peak memory, in fresh processes (the two trained side by side in this one)."""
    _note(f"measuring memory: {MEMORY_STEPS} steps of each configuration, each in a fresh process")
    for r, (mib, error) in zip(runs, peak_rss_growth(cfg, [r["hmp"] for r in runs])):
        r["peak_memory_mib"], r["peak_memory_error"] = mib, error
        if error:
            _note(f"warning: memory of {r['configuration']} not measured: {error}")


def _write_json(path, res):
    try:
        with open(path, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")
    except OSError as e:
        return _error(f"--json {path}: {e.strerror or e}", 1)
    return 0


def run(args):
    try:
        return _run(args)
    except KeyboardInterrupt:
        hmp.revert()
        print(file=sys.stderr)
        return _error("interrupted", 130)


def _run(args):
    setup = _setup(args)
    if isinstance(setup, int):
        return setup
    device, options, corpus = setup
    cfg, facts = _plan(args, device, options)
    if args.dry_run:
        _note("--dry-run: stopping before training")
        return 0
    try:
        runs = _train_both(cfg, corpus, options, args.opt_level)
        _note(f"counting hmp's casts per op: {CAST_STEPS} training steps under hmp.profile")
        casts = count_casts(cfg, corpus, options)
    except FloatingPointError as e:
        return _error(str(e), 1)
    _measure_memory(cfg, runs)
    res = report.results(cfg, corpus, runs, casts, facts)
    print(report.format_report(res), flush=True)
    return _write_json(args.json, res) if args.json else 0
