"""hmp benchmark harness: fp32, torch.autocast, hmp (O1 default lists, O1
with autocast's lists, O2) and pure bf16, measured in one process with the
configurations interleaved (A B C D ... A B C D ...) and medians reported.

    python benchmarks/run.py                       # everything, CPU (~10 min on 2 cores)
    python benchmarks/run.py --workload mlp,percall --reps 9
    python benchmarks/run.py --quick --json out.json
    python benchmarks/run.py --device cuda

Workloads: transformer, mlp, infer_b1, infer_b16, cnn, accumulate (model steps) and
percall (per-call overhead micro-benchmark). Peak memory of every
(workload, configuration) is measured in its own subprocess unless
--no-memory is given. The benchmarked hmp is the one in this checkout.
"""

import argparse
import functools
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from operator import itemgetter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(HERE), str(ROOT)):  # this checkout's hmp, and the sibling modules
    if p not in sys.path:
        sys.path.insert(0, p)

import micro  # noqa: E402
import torch  # noqa: E402
from configs import all_configs, select  # noqa: E402
from workloads import all_workloads  # noqa: E402

import hmp  # noqa: E402
from hmp.demo.procmem import start_peak  # noqa: E402
from hmp.tools.timing import Stopwatch, interleaved, iqr_rel, per_call  # noqa: E402

ALIASES = {"transformer_train": "transformer", "mlp_train": "mlp", "cnn_train": "cnn", "micro": "percall"}
HMP = "hmp-O1"  # the configuration the targets are stated for

# (workload, numerator, denominator, op, threshold); "HMP" is replaced by the hmp config
# issue 48's: where the floor's own ratio (the "floor" configuration) exceeds a target, the floor is the bound
TARGETS = [
    ("transformer", "HMP", "autocast", "<=", 0.97),
    ("transformer", "HMP", "bf16", "<=", 1.04),
    ("transformer", "fp32", "HMP", ">=", 2.4),
    ("mlp", "HMP", "autocast", "<=", 1.10),
    ("infer_b1", "HMP", "autocast", "<=", 1.10),
    ("infer_b1", "HMP", "bf16", "<=", 1.15),
    # weight casts kept for a region: hmp.frozen_weights() against one autocast region per forward
    ("infer_b1", "hmp-O1-frozen", "autocast", "<=", 0.95),
    # issue 56: each weight cast once per optimizer step inside hmp.accumulation(), per micro-batch by autocast
    ("accumulate", "hmp-O1-acc", "autocast", "<=", 0.95),
]
MEMORY_TARGET = 1.0
PERCALL_MIN_US = 0.2
MEMORY_MIN_MB = 4.0  # memory ratios are only formed when autocast's peak is at least this


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def sync_fn(device):
    if device == "cuda":
        return torch.cuda.synchronize
    return lambda: None


# ---------------------------------------------------------------- timing


def measure_workload(w, configs, device, quick, reps):
    sync = sync_fn(device)
    iters = w.quick_iters if quick else w.iters
    states = {}
    for c in configs:
        states[c.name] = w.build(c, device, quick)
    out_dtype, expected = {}, {}
    for c in configs:  # own warm-up per configuration
        st = states[c.name]
        with c.active():
            for _ in range(1 if quick else w.warmup):
                out = w.step(st, c, device)
            sync()
            expected[c.name] = w.expected_dtype(c, device)
        out_dtype[c.name] = str(out.dtype).replace("torch.", "")

    def sample(c):
        gc.collect()
        with c.active():  # hmp.convert / revert stay outside the timed region
            return per_call(functools.partial(w.step, states[c.name], c, device), iters, sync) * 1e3

    def each_rep(rep, samples):
        log(f"  {w.name} rep {rep + 1}/{reps}: " + "  ".join(f"{n} {s[-1]:.2f}" for n, s in samples.items()))

    # interleaved: A B C D ... per repetition, in the same order every time
    samplers = {c.name: functools.partial(sample, c) for c in configs}
    samples = interleaved(samplers, reps, rotate=False, after_round=each_rep)
    states.clear()  # the models go before the next workload's are built
    gc.collect()
    return {
        "description": w.description,
        "iters_per_sample": iters,
        "reps": reps,
        "median_ms": {n: statistics.median(s) for n, s in samples.items()},
        "min_ms": {n: min(s) for n, s in samples.items()},
        "iqr_rel": {n: iqr_rel(s) for n, s in samples.items()},
        "samples_ms": samples,
        "out_dtype": out_dtype,
        "expected_dtype": expected,
    }


def convert_cost(configs, n=7):
    """Median wall time of hmp.convert and hmp.revert per hmp configuration."""
    out = {}
    for c in configs:
        if not c.is_hmp:
            continue
        conv, rev = [], []
        for _ in range(n):
            conv.append(per_call(functools.partial(hmp.convert, **c.hmp_args)) * 1e3)
            rev.append(per_call(hmp.revert) * 1e3)
        out[c.name] = {"convert_ms": statistics.median(conv), "revert_ms": statistics.median(rev)}
    return out


# ---------------------------------------------------------------- memory


def memory_child(workloads, config, device, quick, steps):
    """Run in its own process: for each workload, the peak memory of ``steps``
    steps above a baseline taken after model and data construction.

    A throwaway copy of the workload runs one step first (then is freed), so
    one-time runtime costs (kernel code, thread pools, allocator arenas) are
    paid before the baseline and not charged to the configuration."""
    c = {x.name: x for x in all_configs(device)}[config]
    by_name = {x.name: x for x in all_workloads()}
    out = []
    for name in workloads:
        w = by_name[name]
        tmp = w.build(c, device, quick)
        with c.active():
            w.step(tmp, c, device)
        del tmp
        st = w.build(c, device, quick)
        gc.collect()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() / 2**20
            method = "torch.cuda.max_memory_allocated - memory_allocated at baseline"
        else:
            base, read_peak, method = start_peak()
        with c.active():
            for _ in range(steps):
                w.step(st, c, device)
        if device == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**20
        else:
            peak = read_peak()
        del st
        gc.collect()
        out.append(
            {
                "workload": name,
                "config": config,
                "baseline_mb": base,
                "peak_mb": peak,
                "delta_mb": peak - base,
                "steps": steps,
                "method": method,
            }
        )
    return out


def measure_memory(workloads, configs, device, quick, steps):
    """One subprocess per (workload, configuration); with --quick, one per
    configuration running the workloads in turn (Linux resets the RSS
    high-water mark between them)."""
    env = dict(os.environ)
    # large allocations go to mmap and back to the OS when freed, so RSS follows live memory
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    names = [w.name for w in workloads]
    groups = [names] if quick and sys.platform.startswith("linux") else [[n] for n in names]
    jobs = []
    for c in configs:
        for group in groups:
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--child-memory",
                f"{','.join(group)}:{c.name}",
                "--device",
                device,
                "--memory-steps",
                str(steps),
                "--threads",
                str(torch.get_num_threads()),
            ]
            cmd += ["--quick"] if quick else []
            cmd += [] if torch.backends.mha.get_fastpath_enabled() else ["--no-fastpath"]
            jobs.append((f"{','.join(group)}:{c.name}", cmd))
    # timing is over, so the children may run side by side: each one measures only its own RSS
    width = 1 if device == "cuda" else max(1, os.cpu_count() or 1)
    out = {n: {} for n in names}
    running = []
    while jobs or running:
        while jobs and len(running) < width:
            label, cmd = jobs.pop(0)
            running.append(
                (label, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            )
        label, p = running.pop(0)
        stdout, stderr = p.communicate()
        if p.returncode != 0:
            for _, q in running:
                q.kill()
            raise RuntimeError(f"memory child {label} failed:\n{stderr}")
        for row in json.loads(stdout.strip().splitlines()[-1]):
            out[row["workload"]][row["config"]] = row
            log(f"  memory {row['workload']:12s} {row['config']:10s} +{row['delta_mb']:.1f} MB")
    return out


# ---------------------------------------------------------------- report


def ratio(a, b):
    return a / b if b else float("nan")


def evaluate_targets(res, hmp_names):
    rows = []
    wl = res["workloads"]
    for workload, num, den, op, thr in TARGETS:
        if workload not in wl:
            continue
        med = wl[workload]["median_ms"]
        vals = {}
        for h in hmp_names:
            n, d = (h if num == "HMP" else num), (h if den == "HMP" else den)
            if n in med and d in med:
                vals[h] = ratio(med[n], med[d])
        if vals:
            row = {"workload": workload, "metric": f"{num} / {den}", "op": op, "target": thr, "values": vals}
            if "HMP" in (num, den) and "floor" in med:  # the same ratio for the floor: what a Python wrapper can reach
                fn, fd = ("floor" if num == "HMP" else num), ("floor" if den == "HMP" else den)
                if fn in med and fd in med:
                    row["floor"] = ratio(med[fn], med[fd])
            rows.append(row)
    if "percall" in res:
        vals = {
            h: micro.overhead_ratio(res["percall"], h)
            for h in hmp_names
            if h in res["percall"]["ops"]["linear"]["median_us"]
        }
        rows.append(
            {
                "workload": "percall",
                "metric": "(HMP - plain) / (autocast - plain), summed over linear+mul+cat",
                "op": "<=",
                "target": 1.0,
                "values": vals,
            }
        )
    for workload, per in res.get("memory", {}).items():
        if "autocast" not in per or per["autocast"]["delta_mb"] < MEMORY_MIN_MB:
            continue  # nothing measurable to compare against
        vals = {h: ratio(per[h]["delta_mb"], per["autocast"]["delta_mb"]) for h in hmp_names if h in per}
        if vals:
            rows.append(
                {
                    "workload": workload,
                    "metric": "peak memory HMP / autocast",
                    "op": "<=",
                    "target": MEMORY_TARGET,
                    "values": vals,
                }
            )
    for r in rows:
        r["pass"] = {h: (v <= r["target"] if r["op"] == "<=" else v >= r["target"]) for h, v in r["values"].items()}
    return rows


def _mark(ok):
    return "PASS" if ok else "FAIL"


def _fmt_load(v):
    return "/".join(f"{x:.1f}" for x in v) if v else "n/a"


def _config_table(rows, cfgs, values, fmt, align="---:|", last=None):
    """Markdown lines of a table with a row per item of ``rows`` (name -> what
    was measured) and a column per configuration: ``fmt`` of the value
    ``values(measured)`` holds for it, blank where it has none. ``last``:
    ``(title, measured -> text)``, one more column at the end."""
    names = [c["name"] for c in cfgs]
    out = [
        "| workload | " + " | ".join(names) + (f" | {last[0]}" if last else "") + " |",
        "|---|" + align * len(names) + ("---|" if last else ""),
    ]
    for name, measured in rows.items():
        got = values(measured)
        cells = " | ".join(fmt.format(got[n]) if n in got else "" for n in names)
        out.append(f"| {name} | {cells}" + (f" | {last[1](measured)}" if last else "") + " |")
    return out


def _samples(w):
    return f"{w['reps']} x {w['iters_per_sample']}"


def markdown(res):
    meta = res["meta"]
    cfgs = meta["configs"]
    L = [
        f"# hmp benchmark ({meta['device']})",
        "",
        f"- torch {meta['torch']}, hmp {meta['hmp_version']} from `{meta['hmp_path']}`, python {meta['python']}",
        f"- machine: {meta['machine']}; torch threads: {meta['threads']}; load average (1/5/15 min) at start "
        f"{_fmt_load(meta.get('loadavg_start'))}, at end {_fmt_load(meta.get('loadavg_end'))}",
        f"- command: `{meta['command']}`; {'QUICK (small sizes) ' if meta['quick'] else ''}"
        f"wall time {meta.get('wall_s', 0):.0f} s",
        "- medians of interleaved samples (configurations run A B C D ... per repetition, each with a fresh "
        "model from the same seed and its own warm-up); hmp.convert/revert happen outside the timed region",
        "",
    ]
    if res.get("convert_cost"):
        L.append(
            "- hmp.convert / revert cost (median): "
            + "; ".join(
                f"{n}: {v['convert_ms']:.1f} ms / {v['revert_ms']:.2f} ms" for n, v in res["convert_cost"].items()
            )
        )
        L.append("")
    if res["workloads"]:
        workloads = res["workloads"]
        L += ["## Time per step (ms, median)", ""]
        L += _config_table(workloads, cfgs, itemgetter("median_ms"), "{:.3f}", last=("samples x steps", _samples))
        L += ["", "Noise: interquartile range / median of the samples (0.05 = 5 %):", ""]
        L += _config_table(workloads, cfgs, itemgetter("iqr_rel"), "{:.2f}")
        L += ["", "Fastest sample (ms; a cross-check of the medians that is less sensitive to other load):", ""]
        L += _config_table(workloads, cfgs, itemgetter("min_ms"), "{:.3f}")
        L += [
            "",
            "Output dtype of the model in each configuration (each checked against the dtype its workload states; "
            "off nn.TransformerEncoder's fused path, as under autocast on CUDA, the encoder ends in layer_norm "
            "of a float32 residual: float32 unless the scheme lowers layer_norm, as hmp does only under strict=True):",
            "",
        ]
        L += _config_table(workloads, cfgs, itemgetter("out_dtype"), "{}", align="---|")
        L += [
            "",
            "Ratios of medians (time / time):",
            "",
            "| workload | "
            + " | ".join(f"{c['name']} / autocast" for c in cfgs if c["name"] != "autocast")
            + " | "
            + " | ".join(f"{c['name']} / bf16" for c in cfgs if c["name"] not in ("bf16",))
            + " |",
            "|---|" + "---:|" * (2 * len(cfgs) - 2),
        ]
        for name, w in res["workloads"].items():
            m = w["median_ms"]
            a = [
                f"{ratio(m[c['name']], m['autocast']):.3f}" if "autocast" in m and c["name"] in m else ""
                for c in cfgs
                if c["name"] != "autocast"
            ]
            b = [
                f"{ratio(m[c['name']], m['bf16']):.3f}" if "bf16" in m and c["name"] in m else ""
                for c in cfgs
                if c["name"] != "bf16"
            ]
            L.append(f"| {name} | " + " | ".join(a + b) + " |")
        L += ["", "Workloads:", ""] + [f"- **{n}**: {w['description']}" for n, w in res["workloads"].items()] + [""]
    if "percall" in res:
        pc = res["percall"]
        modes = list(pc["modes"])
        hm = [m for m in modes if m.startswith("hmp")]
        L += [
            f"## Per-call overhead (us per call, median; {pc['size']}x{pc['size']} fp32 tensors, "
            f"{pc['calls_per_sample']} calls x {pc['reps']} samples)",
            "",
            "| op | "
            + " | ".join(modes)
            + " | "
            + " | ".join(f"{m} - plain" for m in modes[1:])
            + " | "
            + " | ".join(f"({m} - plain) / (autocast - plain)" for m in hm)
            + " |",
            "|---|" + "---:|" * (2 * len(modes) - 1 + len(hm)),
        ]
        rows = [(op, (op,)) for op in pc["ops"]] + [("sum", tuple(pc["ops"]))]
        for label, ops in rows:
            med = {m: sum(pc["ops"][op]["median_us"][m] for op in ops) for m in modes}
            if label == "sum":
                cells = [f"{med[m]:.2f}" for m in modes]
            else:
                dt = pc["ops"][label]["out_dtype"]
                cells = [f"{med[m]:.2f} ({dt[m]})" for m in modes]
            over = [f"{med[m] - med['plain']:+.2f}" for m in modes[1:]]
            den = med["autocast"] - med["plain"]
            rat = [f"{(med[m] - med['plain']) / den:.2f}" if den >= PERCALL_MIN_US else "n/a" for m in hm]
            L.append(f"| {label} | " + " | ".join(cells + over + rat) + " |")
        L += ["", f"(output dtype in parentheses; a ratio needs autocast - plain >= {PERCALL_MIN_US} us)", ""]
    if res.get("memory"):
        L += ["## Peak memory above baseline (MB; each configuration in its own process)", ""]
        L += _config_table(res["memory"], cfgs, lambda per: {n: row["delta_mb"] for n, row in per.items()}, "{:.1f}")
        any_row = next(iter(next(iter(res["memory"].values())).values()))
        L += [
            "",
            f"Method: {any_row['method']}, over {any_row['steps']} step(s); baseline after imports, model and "
            "data construction and one step of a throwaway copy (one-time runtime costs); large allocations "
            f"mmapped (MALLOC_MMAP_THRESHOLD_=65536) so RSS follows live memory. Ratios only where autocast's peak "
            f"is >= {MEMORY_MIN_MB:g} MB.",
            "",
        ]
    if res.get("targets"):
        hmps = [c["name"] for c in cfgs if c["name"].startswith("hmp")]
        L += [
            "## Targets (HMP = the hmp configuration in each column)",
            "",
            "| workload | ratio | target | " + " | ".join(hmps) + " | the floor's |",
            "|---|---|---|" + "---|" * len(hmps) + "---|",
        ]
        for r in res["targets"]:
            cells = [f"{r['values'][h]:.3f} {_mark(r['pass'][h])}" if h in r["values"] else "" for h in hmps]
            bound = f"{r['floor']:.3f}" if "floor" in r else ""
            L.append(
                f"| {r['workload']} | {r['metric']} | {r['op']} {r['target']} | " + " | ".join(cells) + f" | {bound} |"
            )
        L += [
            "",
            f"The issue's targets are stated for `{HMP}` (hmp O1 with its default lists); "
            "`hmp-O1-ac` runs hmp with torch.autocast's own op lists, so it compares the mechanism alone. "
            "The floor's column: the same ratio with the floor (benchmarks/floor.py, the smallest Python wrapper "
            "with hmp O1's casts) in HMP's place, the bound for any design that wraps each listed call in Python.",
            "",
        ]
    return "\n".join(L)


# ---------------------------------------------------------------- self-check


def check_results(res, configs):
    """The harness checks its own results before reporting them: every
    configuration timed ``reps`` times with finite positive samples and
    consistent summaries, each output in the dtype its workload says the
    configuration gives (workloads.py, expected_dtype), a finite memory row per configuration,
    boolean target verdicts. Returns the problems found (empty when none)."""
    names = [c.name for c in configs]
    problems = []
    for wname, w in res["workloads"].items():
        if list(w["median_ms"]) != names:
            problems.append(f"{wname}: medians for {list(w['median_ms'])}, expected {names}")
            continue
        for c in configs:
            s = w["samples_ms"][c.name]
            if len(s) != w["reps"] or not all(x > 0 and math.isfinite(x) for x in s):
                problems.append(f"{wname}/{c.name}: samples {s} ({w['reps']} expected, finite and > 0)")
            elif not min(s) == w["min_ms"][c.name] <= w["median_ms"][c.name] <= max(s):
                problems.append(
                    f"{wname}/{c.name}: min/median {w['min_ms'][c.name]}/{w['median_ms'][c.name]} "
                    f"do not match the samples {s}"
                )
            # what the configuration produces, stated per workload (workloads.py: expected_dtype)
            got, want = w["out_dtype"][c.name], w["expected_dtype"][c.name]
            if got != want:
                problems.append(f"{wname}/{c.name}: output dtype {got}, expected {want}")
    for wname, per in res.get("memory", {}).items():
        if set(per) != set(names):
            problems.append(f"memory {wname}: rows for {sorted(per)}, expected {sorted(names)}")
        problems += [
            f"memory {wname}/{n}: delta {row['delta_mb']} MB"
            for n, row in per.items()
            if not math.isfinite(row["delta_mb"])
        ]
    problems += [
        f"target {r['workload']} {r['metric']}: verdicts {r['pass']}"
        for r in res["targets"]
        if not all(isinstance(v, bool) for v in r["pass"].values())
    ]
    return problems


# ---------------------------------------------------------------- main


def _loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _split(values):
    out = []
    for v in values or []:
        out += [x.strip() for x in v.split(",") if x.strip()]
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--workload",
        "-w",
        action="append",
        help="transformer, mlp, infer_b1, infer_b16, cnn, percall (repeatable or comma list; default all)",
    )
    ap.add_argument(
        "--config",
        "-c",
        action="append",
        help="subset of fp32, autocast, hmp-O1, hmp-O1-ac, hmp-O2, bf16 (default all)",
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--reps", type=int, help="samples per configuration (default: per workload)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--md", metavar="PATH", help="also write the markdown report to PATH")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: leave torch's default)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small sizes, few repetitions, 1 thread unless --threads (smoke test, < 60 s)",
    )
    ap.add_argument(
        "--no-fastpath",
        action="store_true",
        help="turn off nn.TransformerEncoder's fused inference path (what autocast gets on CUDA)",
    )
    ap.add_argument("--no-memory", action="store_true", help="skip the per-configuration peak memory subprocesses")
    ap.add_argument(
        "--memory-steps",
        type=int,
        default=None,
        help="measured steps per memory subprocess (default 1, after one warm-up step)",
    )
    ap.add_argument("--percall-calls", type=int, default=None, help="calls per per-call sample (default 2000)")
    ap.add_argument("--child-memory", metavar="WORKLOAD:CONFIG", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    mem_steps = args.memory_steps or 1
    if args.no_fastpath:
        torch.backends.mha.set_fastpath_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    elif args.quick:  # a smoke test, not a measurement: 1 thread keeps it fast on a busy machine
        torch.set_num_threads(1)
    if args.child_memory:
        workloads, config = args.child_memory.split(":")
        print(json.dumps(memory_child(workloads.split(","), config, args.device, args.quick, mem_steps)))
        return 0

    wall = Stopwatch()
    names = [ALIASES.get(n, n) for n in _split(args.workload)]
    all_w = {w.name: w for w in all_workloads()}
    known = list(all_w) + ["percall"]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {known}")
    names = names or known
    workloads = [all_w[n] for n in names if n in all_w]
    configs = select(all_configs(args.device), _split(args.config))

    machine = f"{platform.machine()}, {os.cpu_count()} CPUs"
    if args.device == "cuda":
        machine += f", GPU {torch.cuda.get_device_name()}"
    meta = {
        "torch": torch.__version__,
        "hmp_version": hmp.__version__,
        "hmp_path": str(Path(hmp.__file__).parent),
        "python": platform.python_version(),
        "device": args.device,
        "threads": torch.get_num_threads(),
        "machine": machine,
        "quick": args.quick,
        "mha_fastpath": torch.backends.mha.get_fastpath_enabled(),
        "command": " ".join(["benchmarks/run.py"] + (argv or sys.argv[1:])),
        "configs": [{"name": c.name, "label": c.label, "hmp_args": c.hmp_args} for c in configs],
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_start": _loadavg(),
    }
    log(f"torch {torch.__version__}, threads {meta['threads']}, device {args.device}, hmp from {meta['hmp_path']}")
    res = {"meta": meta, "workloads": {}}
    res["convert_cost"] = convert_cost(configs)
    for n, v in res["convert_cost"].items():
        log(f"hmp.convert {n}: {v['convert_ms']:.1f} ms, revert {v['revert_ms']:.2f} ms")

    for w in workloads:
        reps = args.reps or (3 if args.quick else w.reps)
        log(f"[{w.name}] {w.description} ({wall.elapsed:.0f} s)")
        res["workloads"][w.name] = measure_workload(w, configs, args.device, args.quick, reps)

    if "percall" in names:
        reps = args.reps or (3 if args.quick else 21)
        calls = args.percall_calls or (200 if args.quick else 2000)
        log(f"[percall] {calls} calls per sample, {reps} samples ({wall.elapsed:.0f} s)")
        res["percall"] = micro.run(args.device, reps, calls, sync_fn(args.device), progress=log)

    if not args.no_memory and workloads:
        log(f"[memory] {len(workloads) * len(configs)} measurements, {mem_steps} step(s) each ({wall.elapsed:.0f} s)")
        res["memory"] = measure_memory(workloads, configs, args.device, args.quick, mem_steps)

    res["targets"] = evaluate_targets(res, [c.name for c in configs if c.is_hmp])
    problems = check_results(res, configs)
    if problems:
        raise SystemExit("benchmarks/run.py: its results fail its own checks:\n  " + "\n  ".join(problems))
    meta["wall_s"] = wall.elapsed
    meta["loadavg_end"] = _loadavg()
    md = markdown(res)
    print(md)
    if args.md:
        Path(args.md).write_text(md + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0


# its quickest run that still goes through its code (tests/integration/test_benchmark_scripts.py)
QUICK = ("--quick", "--workload", "mlp", "--no-memory")


if __name__ == "__main__":
    sys.exit(main())
