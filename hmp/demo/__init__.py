"""``python -m hmp demo``: train a small character-level transformer on the
Python standard library's own source, in fp32 and then under hmp, and print
how fast each trained and how well each learned.

The pieces are importable: ``data`` (stdlib text to character ids),
``model`` (the transformer) and ``training`` (one training run, measured;
its cast count per op comes from ``hmp.profile``). This module is only the command
line: arguments, progress bars, the table and the JSON file.
"""

import json
import os
import platform
import sys
import time

import torch

import hmp
from hmp.demo import data as data_mod
from hmp.demo import sizing
from hmp.demo.training import (
    CAST_STEPS,
    MEMORY_STEPS,
    Config,
    DeviceError,
    count_casts,
    matmul_time_vs_fp32,
    model_summary,
    peak_rss_growth,
    resolve_device,
    train,
)
from hmp.tools.arguments import positive_int, seed
from hmp.tools.progress import Progress

PROG = "python -m hmp demo"
DEFAULTS = Config()
STEPS = 120  # the most steps a default (sized) run trains
LONG_STEPS = DEFAULTS.steps
# seconds both configurations' training may take together in a default run, measured on the machine it
# runs on; the rest of the run (timing, memory, casts, evaluation) takes about a third of that again
BUDGET_S = 40.0
# seconds between progress lines when stderr is no terminal (a log, CI)
LINE_EVERY_S = 10.0


def add_parser(subparsers):
    p = subparsers.add_parser(
        "demo",
        help="train a small transformer on the stdlib's source, fp32 vs hmp",
        description="Train the same character-level transformer language model twice from the same seed, "
        "on the Python standard library's source files: in fp32, then under hmp.convert(). "
        "Prints speed, memory, losses and hmp's casts per op.",
    )
    length = p.add_mutually_exclusive_group()
    length.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help=f"training steps per configuration (default: as many as fit about a minute on this "
        f"machine, measured before training, at most {STEPS}; the model shrinks when fewer "
        f"than {sizing.MIN_STEPS} would fit)",
    )
    length.add_argument(
        "--long",
        dest="steps",
        action="store_const",
        const=LONG_STEPS,
        help=f"a longer run: {LONG_STEPS} steps per configuration of the full model (minutes)",
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help=f"sequences of {DEFAULTS.seq_len} characters per step (default {DEFAULTS.batch_size})",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda", "hpu"),
        default="auto",
        help="auto: cuda if available, then hpu when habana_frameworks is installed, else cpu",
    )
    p.add_argument("--opt-level", choices=("O1", "O2"), default="O1", help="hmp opt_level (default O1)")
    p.add_argument("--bf16-file", default="", metavar="PATH", help="hmp BF16 list file (default: hmp's own)")
    p.add_argument("--fp32-file", default="", metavar="PATH", help="hmp FP32 list file (default: hmp's own)")
    p.add_argument("--seed", type=seed, default=DEFAULTS.seed, help=f"random seed (default {DEFAULTS.seed})")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.set_defaults(run=run)
    return p


class _Progress:
    """One configuration's training, shown by hmp.tools.progress."""

    def __init__(self, label, steps):
        self.label = label
        self.progress = Progress(f"training {label}", steps, PROG, every_s=LINE_EVERY_S)

    def __call__(self, step, loss):
        self.progress.step(f"loss {loss:.3f}", done=step + 1)

    def close(self, result=None):
        self.progress.close(
            None
            if result is None
            else f"trained {self.label} in {result['wall_s']:.1f} s, val loss {result['val_loss']:.4f}"
        )


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
        _note("warning: --opt-level O2 uses hmp's O2 lists; ignoring --bf16-file/--fp32-file")
    return options


def _check_hmp_options(options):
    """Convert once and revert, so a bad list file fails before any training."""
    try:
        with hmp.converted(**options):
            pass
    except OSError as e:
        return e.strerror or str(e)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def _fmt_int(x):
    return f"{x:,.0f}"


def _casts_line(per_op, top=6):
    parts = []
    for op, by_dtype in list(per_op.items())[:top]:
        dtypes = ", ".join(f"->{'bf16' if d == 'bfloat16' else 'fp16' if d == 'float16' else 'fp32'}" for d in by_dtype)
        parts.append(f"{op} {sum(by_dtype.values()):g} ({dtypes})")
    more = len(per_op) - top
    return ", ".join(parts) + (f", and {more} more ops" if more > 0 else "") if parts else "none"


def format_report(res):
    """The text report for a results dict (what --json writes)."""
    m, rows = res["meta"], res["results"]
    mem_title = "peak RSS growth" if m["memory_kind"] == "rss" else "peak memory"
    head = ("configuration", "tokens/s", "time vs fp32", mem_title, "train loss", "val loss", "train time")
    body = []
    for r in rows:
        mem = "n/a" if r["peak_memory_mib"] is None else f"{r['peak_memory_mib']:,.0f} MiB"
        body.append(
            (
                r["configuration"],
                _fmt_int(r["tokens_per_s"]),
                f"{r['time_vs_fp32']:.2f}x",
                mem,
                f"{r['train_loss']:.4f}",
                f"{r['val_loss']:.4f}",
                f"{r['wall_s']:.1f} s",
            )
        )
    widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]
    line = lambda row: "  ".join(
        c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
        for i, (c, w) in enumerate(zip(row, widths))
    )
    c = res["casts"]
    out = [
        f"hmp demo: character-level transformer LM, fp32 vs hmp ({m['device']}, torch {m['torch']}, "
        f"{m['threads']} threads)",
        f"  data:  Python {m['python']} standard library source, {m['train_files']} files / "
        f"{_fmt_int(m['train_chars'])} chars train, {m['val_files']} files / {_fmt_int(m['val_chars'])} chars "
        f"validation",
        f"  model: {m['n_layers']} pre-norm blocks, d_model {m['d_model']}, {m['n_heads']} heads, context "
        f"{m['seq_len']}, {m['params'] / 1e6:.2f}M parameters; {m['steps']} steps of {m['batch_size']} "
        f"sequences, AdamW, seed {m['seed']}",
        "",
        line(head),
        line(tuple("-" * w for w in widths)),
        *(line(row) for row in body),
        "",
        f"val loss: hmp {res['val_loss_change_pct']:+.2f}% vs fp32; unigram baseline {m['unigram_baseline']:.4f} "
        f"(losses are cross-entropy in nats/char)",
        f"this {m['device']}: a bfloat16 matmul of the model's size takes {m['bf16_matmul_time_vs_fp32']:.2f}x "
        f"float32's time (measured now; below 1 is faster); no bf16 scheme gains more than that on the matmuls",
        f"casts hmp made per training step (forward; {c['total_per_step']:g} casts in {c['op_calls_per_step']:g} "
        f"op calls): {_casts_line(c['per_op'])}",
        f"tokens/s: median step after {m['timing_warmup']} warm-up steps; train loss: mean of the last "
        f"{m['loss_window']} steps; train time: the whole training loop",
    ]
    if m["memory_kind"] == "rss":
        out.append(
            f"{mem_title}: resident memory added by {MEMORY_STEPS} training steps, each configuration "
            "in a fresh process"
        )
    else:
        out.append(f"{mem_title}: peak allocated by torch on {m['device']} during training")
    return "\n".join(out)


def _sized(cfg, options, fixed_batch):
    """The run that fits BUDGET_S on this machine (sizing.fit), said in a line."""
    ladder = sizing.LADDER
    if fixed_batch:  # a batch size the user chose stays
        ladder = tuple(dict(fields, batch_size=cfg.batch_size) for fields in ladder)
        ladder = tuple(f for i, f in enumerate(ladder) if f not in ladder[:i])

    def measure(c):
        return sum(sizing.step_seconds(c, [None, options]))

    sized = sizing.fit(cfg, measure, BUDGET_S, STEPS, ladder)
    c = sized.cfg
    shrunk = (
        f"; a smaller model than the default ({c.n_layers} blocks of width {c.d_model}, batch "
        f"{c.batch_size} x {c.seq_len}) so that {sizing.MIN_STEPS}+ steps fit"
        if sized.shrunk
        else ""
    )
    _note(
        f"sized to this machine: {c.steps} steps per configuration, about {sized.seconds:.0f} s of training "
        f"for both{shrunk}; --steps N or --long to choose"
    )
    return c


def run(args):
    try:
        return _run(args)
    except KeyboardInterrupt:
        hmp.revert()
        print(file=sys.stderr)
        return _error("interrupted", 130)


def _run(args):
    if args.json:
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            return _error(f"--json {args.json}: directory {parent!r} does not exist")
    try:
        device = resolve_device(args.device)
    except DeviceError as e:
        return _error(str(e))
    options = _hmp_options(args)
    problem = _check_hmp_options(options)
    if problem:
        return _error(problem)
    try:
        corpus = data_mod.load()
    except data_mod.DataError as e:
        return _error(str(e), 1)

    cfg = Config(
        steps=args.steps or STEPS, batch_size=args.batch_size or DEFAULTS.batch_size, seed=args.seed, device=device
    )
    ratio = matmul_time_vs_fp32(cfg)
    native = sizing.native_bf16(device)
    _note(f"this {device}: {sizing.expectation(ratio, native)}")
    if args.steps is None:
        cfg = _sized(cfg, options, fixed_batch=args.batch_size is not None)
    low = "bfloat16"
    hmp_label = f"hmp {args.opt_level} ({low})"
    results = []
    try:
        for label, opts in (("fp32", None), (hmp_label, options)):
            progress = _Progress(label, cfg.steps)
            result = None
            try:
                result = train(cfg, corpus, opts, on_step=progress)
            finally:
                progress.close(result)
            result["configuration"] = label
            result["hmp"] = opts
            results.append(result)
        per_op, total, calls = count_casts(cfg, corpus, options)
    except FloatingPointError as e:
        return _error(str(e), 1)

    memory_kind = "rss" if device == "cpu" else "allocated"
    if device == "cpu":
        if sys.stderr.isatty():
            _note(f"measuring memory: {MEMORY_STEPS} steps per configuration, each in a fresh process")
        for r, (mib, error) in zip(results, peak_rss_growth(cfg, [r["hmp"] for r in results])):
            r["peak_memory_mib"], r["peak_memory_error"] = mib, error
            if error:
                _note(f"warning: memory of {r['configuration']} not measured: {r['peak_memory_error']}")
    base = results[0]
    for r in results:
        r["time_vs_fp32"] = base["tokens_per_s"] / r["tokens_per_s"]  # below 1 is faster
    res = {
        "meta": {
            "device": device,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "stdlib": str(corpus.root),
            "train_files": len(corpus.train_files),
            "val_files": len(corpus.val_files),
            "train_chars": corpus.train.numel(),
            "val_chars": corpus.val.numel(),
            "unigram_baseline": corpus.unigram_baseline(),
            "params": model_summary(cfg),
            "memory_kind": memory_kind,
            "hmp_version": hmp.__version__,
            **{
                k: getattr(cfg, k)
                for k in (
                    "steps",
                    "batch_size",
                    "seq_len",
                    "d_model",
                    "n_layers",
                    "n_heads",
                    "dropout",
                    "lr",
                    "seed",
                    "timing_warmup",
                    "loss_window",
                )
            },
            "opt_level": args.opt_level,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "bf16_matmul_time_vs_fp32": ratio,
            "native_bf16": native[0],
            "native_bf16_why": native[1],
        },
        "results": [
            {
                k: r.get(k)
                for k in (
                    "configuration",
                    "tokens_per_s",
                    "time_vs_fp32",
                    "peak_memory_mib",
                    "train_loss",
                    "val_loss",
                    "wall_s",
                    "hmp",
                    "losses",
                )
            }
            for r in results
        ],
        "val_loss_change_pct": 100.0 * (results[1]["val_loss"] / base["val_loss"] - 1.0),
        "casts": {"per_op": per_op, "total_per_step": total, "op_calls_per_step": calls, "steps_counted": CAST_STEPS},
    }
    print(format_report(res), flush=True)
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
                f.write("\n")
        except OSError as e:
            return _error(f"--json {args.json}: {e.strerror or e}", 1)
    return 0
