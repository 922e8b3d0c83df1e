"""The demo's results: the dict ``--json`` writes, and the text table printed from it."""

import platform
import time

import torch

import hmp
from hmp.demo.training import BLOCK, CAST_STEPS, MEMORY_STEPS
from hmp.tools import speed, timing

META_FIELDS = (
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
RESULT_FIELDS = (
    "configuration",
    "tokens_per_s",
    "time_vs_fp32",
    "time_ratio",
    "peak_memory_mib",
    "train_loss",
    "val_loss",
    "wall_s",
    "hmp",
    "losses",
    "step_s",
)


def describe_model(m):
    """The model in words, from Config's fields (or the meta dict)."""
    return (
        f"{m['n_layers']} pre-norm blocks of width {m['d_model']} ({m['n_heads']} heads), "
        f"{m['params'] / 1e6:.2f}M parameters, batches of {m['batch_size']} x {m['seq_len']} characters"
    )


def results(cfg, corpus, runs, casts, facts):
    """The results dict: ``runs`` the two train() results (fp32 first),
    ``casts`` count_casts()'s triple, ``facts`` what was measured or chosen
    before training (matmul ratio, native bf16, the plan, params, opt level)."""
    base = runs[0]
    warm = cfg.timing_warmup if cfg.steps > cfg.timing_warmup else 0  # as tokens/s: a short run keeps them all
    for r in runs:  # the i-th steps of the two, taken at most 2 x BLOCK steps apart, are a pair
        samples = [(base, r)[i].get("step_samples") or (base, r)[i]["step_s"] for i in (0, 1)]
        ratio = timing.ratio(samples[0][warm:], samples[1][warm:])
        r["time_ratio"] = ratio.as_dict() if ratio is not None else None
        # below 1 is faster (fp32's own: 1.0); None where the machine did not let it be measured (speed.py says why)
        judged = ratio is not None and ratio.judged
        r["time_vs_fp32"] = 1.0 if r is base else ratio.median if judged else None
    per_op, total, calls = casts
    meta = {
        "device": cfg.device,
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
        "memory_kind": "rss" if cfg.device == "cpu" else "allocated",
        "hmp_version": hmp.__version__,
        **{k: getattr(cfg, k) for k in META_FIELDS},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **facts,
    }
    return {
        "meta": meta,
        "results": [{k: r.get(k) for k in RESULT_FIELDS} for r in runs],
        "val_loss_change_pct": 100.0 * (runs[1]["val_loss"] / base["val_loss"] - 1.0),
        "casts": {"per_op": per_op, "total_per_step": total, "op_calls_per_step": calls, "steps_counted": CAST_STEPS},
    }


def _fmt_int(x):
    return f"{x:,.0f}"


def _casts_line(per_op, top=6):
    parts = []
    for op, by_dtype in list(per_op.items())[:top]:
        dtypes = ", ".join(f"->{'bf16' if d == 'bfloat16' else 'fp16' if d == 'float16' else 'fp32'}" for d in by_dtype)
        parts.append(f"{op} {sum(by_dtype.values()):g} ({dtypes})")
    more = len(per_op) - top
    return ", ".join(parts) + (f", and {more} more ops" if more > 0 else "") if parts else "none"


def _ratio(fields):
    return None if fields is None else timing.Ratio.from_dict(fields)


def time_line(res):
    """What the time column says and how sure it is (speed.py words it)."""
    m, r = res["meta"], res["results"][-1]
    return speed.demo_time_line(_ratio(r["time_ratio"]), BLOCK, m["timing_warmup"], m["device"])


def _table(res, mem_title):
    head = ("configuration", "tokens/s", "time vs fp32", mem_title, "train loss", "val loss", "train time")
    body = []
    for r in res["results"]:
        mem = "n/a" if r["peak_memory_mib"] is None else f"{r['peak_memory_mib']:,.0f} MiB"
        body.append(
            (
                r["configuration"],
                _fmt_int(r["tokens_per_s"]),
                "1.00x" if r is res["results"][0] else speed.cell(_ratio(r["time_ratio"])),
                mem,
                f"{r['train_loss']:.4f}",
                f"{r['val_loss']:.4f}",
                f"{r['wall_s']:.1f} s",
            )
        )
    widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]

    def line(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return [line(head), line(tuple("-" * w for w in widths)), *(line(row) for row in body)]


def format_report(res):
    """The text report for a results dict (what --json writes)."""
    m, c = res["meta"], res["casts"]
    mem_title = "peak RSS growth" if m["memory_kind"] == "rss" else "peak memory"
    out = [
        f"hmp demo: character-level transformer LM, fp32 vs hmp ({m['device']}, torch {m['torch']}, "
        f"{m['threads']} threads)",
        f"  data:  Python {m['python']} standard library source, {m['train_files']} files / "
        f"{_fmt_int(m['train_chars'])} chars train, {m['val_files']} files / {_fmt_int(m['val_chars'])} chars "
        f"validation",
        f"  model: {describe_model(m)}, context {m['seq_len']}; {m['steps']} steps, AdamW, seed {m['seed']}",
        "",
        *_table(res, mem_title),
        "",
        f"val loss: hmp {res['val_loss_change_pct']:+.2f}% vs fp32; unigram baseline {m['unigram_baseline']:.4f} "
        f"(losses are cross-entropy in nats/char)",
        speed.demo_matmul_line(m["device"], _ratio(m.get("bf16_matmul_ratio")) or m["bf16_matmul_time_vs_fp32"]),
        f"casts hmp made per training step (forward; {c['total_per_step']:g} casts in {c['op_calls_per_step']:g} "
        f"op calls): {_casts_line(c['per_op'])}",
        f"tokens/s: median step after {m['timing_warmup']} warm-up steps; train loss: mean of the last "
        f"{m['loss_window']} steps",
        time_line(res),
    ]
    if m["memory_kind"] == "rss":
        out.append(
            f"{mem_title}: resident memory added by {MEMORY_STEPS} training steps, each configuration "
            "in a fresh process"
        )
    else:
        out.append(
            f"{mem_title}: peak allocated by torch on {m['device']} in {MEMORY_STEPS} training steps, each "
            "configuration in a fresh process"
        )
    return "\n".join(out)
