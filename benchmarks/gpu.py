"""hmp on a GPU in one command (issue 40, item 6): fp32, torch.autocast,
hmp O1 (plain, and inside ``hmp.frozen_weights()`` for decode) and a
pure-bf16 model, interleaved, written to ``benchmarks/RESULTS-cuda.md``.

    python benchmarks/gpu.py                      # a CUDA machine
    python benchmarks/gpu.py --dry-run --out x.md # the same code paths on the CPU, tiny sizes

Sized to finish in under 5 minutes; not yet timed on a GPU. The four
inductor compiles of GPT-2 124M should be most of it (each part's seconds
are in the report); ``--parts train,decode,percall`` leaves them out.

Parts: GPT-2 124M training (batch 8x1024, AdamW) eager and under
``torch.compile``; Llama 1.1B (TinyLlama's shape) batch-1 greedy decode
(benchmarks/decode.py); the per-call table (benchmarks/percall.py). Models
are built from configs (random init, nothing downloaded). Each round runs
every configuration once, the order rotated each round; hmp is converted
for its own samples only, outside the timed region. Medians, ratios to
autocast's. ``--dry-run`` measures nothing: it checks the script (the
compiled part then uses the aot_eager backend, which needs no compiler).
"""

import argparse
import contextlib
import copy
import functools
import platform
import statistics
import sys
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for p in (str(HERE), str(HERE.parent)):  # the sibling modules, and this checkout's hmp
    if p not in sys.path:
        sys.path.insert(0, p)

import decode  # noqa: E402
import percall  # noqa: E402
import workloads  # noqa: E402

import hmp  # noqa: E402
from hmp.tools.timing import Stopwatch, interleaved, per_call  # noqa: E402

TRAIN_CONFIGS = ("fp32", "autocast", "hmp-O1", "bf16")
# GPT-2 sizes: workloads.GPT2 ("full", "dry", "cpu")
LLAMA_DRY = dict(workloads.LLAMA["proxy"], num_hidden_layers=2, max_position_embeddings=128)
# per part: the full run's sizes and rounds, then the dry run's
PLAN = {
    "full": dict(batch=(8, 1024), rounds=8, steps=3, c_rounds=3, c_steps=3, new=32, d_rounds=5, reps=5, calls=200),
    "dry": dict(batch=(2, 32), rounds=2, steps=1, c_rounds=1, c_steps=1, new=4, d_rounds=1, reps=1, calls=5),
    "cpu": dict(batch=(4, 128), rounds=7, steps=3, c_rounds=7, c_steps=3, new=8, d_rounds=3, reps=5, calls=100),
}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def peak_start(device):
    if torch.device(device).type == "cuda":
        decode.sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return None


def peak_mib(device, base):
    if base is None:
        return float("nan")  # a CPU's peak is not this process's to read per configuration
    decode.sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def allocator_state(device):
    """What the CUDA caching allocator holds after a round (torch.cuda.memory_stats()): a step time
    that grows round after round shows here as growing segments, allocations or retries."""
    if torch.device(device).type != "cuda":
        return {}
    st = torch.cuda.memory_stats(device)
    keys = (
        "allocated_bytes.all.current",
        "reserved_bytes.all.current",
        "segment.all.current",
        "allocation.all.current",
        "num_alloc_retries",
        "num_device_alloc",
        "num_device_free",
    )
    return {k: st.get(k, 0) for k in keys}


@contextlib.contextmanager
def converted_for(name):
    """hmp O1 for hmp's configurations; reverted on exit, and checked to be."""
    if hmp.is_converted():
        raise RuntimeError(f"{name}: hmp converted on entry")
    with hmp.converted(opt_level="O1") if name.startswith("hmp") else contextlib.nullcontext():
        yield
    if hmp.is_converted():
        raise RuntimeError(f"{name}: hmp still converted after its block")


def train(device, plan, size, compiled, backend):
    """ms per GPT-2 training step per configuration (AdamW; autocast around forward and loss)."""
    # before torch 2.5 transformers builds sdpa's mask with an in-place write torch.compile refuses
    old = torch.torch_version.TorchVersion(torch.__version__) < "2.5"
    base, cfg = workloads.gpt2(size, device, attn="eager" if compiled and old else "sdpa")
    b, t = plan["batch"]
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (b, t), generator=gen).to(device) for _ in range(2)]
    rounds, steps = (plan["c_rounds"], plan["c_steps"]) if compiled else (plan["rounds"], plan["steps"])
    state = {}
    for name in TRAIN_CONFIGS:
        model = copy.deepcopy(base)
        if name == "bf16":
            model = model.to(torch.bfloat16)
        # each configuration compiles its own module, hmp's while converted, so each traces what it runs
        run = torch.compile(model, backend=backend) if compiled else model
        state[name] = dict(model=run, opt=torch.optim.AdamW(model.parameters(), lr=3e-4), k=0, dtypes=set())
    del base

    def step(name):
        s = state[name]
        ids = batches[s["k"] % len(batches)]
        s["k"] += 1
        ctx = torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if name == "autocast" else None
        with ctx or contextlib.nullcontext():
            out = s["model"](input_ids=ids, labels=ids)
        out.loss.backward()
        s["opt"].step()
        s["opt"].zero_grad(set_to_none=True)
        s["dtypes"].add(str(out.logits.dtype).replace("torch.", ""))
        s["loss"] = out.loss  # the last step's, read after the clock stops

    peaks, losses = {}, {}
    memory = {n: [] for n in TRAIN_CONFIGS}  # per round: what the allocator holds, to name a growth's cause
    recompiles = dict.fromkeys(TRAIN_CONFIGS, 0)  # graphs compiled in timed steps: those samples time the compiler
    for name in TRAIN_CONFIGS:  # warm-up (the compile, for torch.compile)
        watch = Stopwatch()
        with converted_for(name):
            step(name)
            step(name)
        log(f"  {'compiled' if compiled else 'eager'} {name}: warm-up {watch.elapsed:.1f} s")

    def sample(name):
        """ms per step of ``steps`` steps, hmp converted for its own, outside the clock."""
        with converted_for(name):
            step(name)  # untimed: a fresh conversion's first step
            base_mem = peak_start(device)
            graphs = _graphs()
            ms = per_call(functools.partial(step, name), steps, functools.partial(decode.sync, device))
            recompiles[name] += _graphs() - graphs
            peaks[name] = peak_mib(device, base_mem)
            losses[name] = float(state[name].pop("loss").detach())
            memory[name].append(allocator_state(device))
        return ms * 1e3

    def each_round(r, times):
        log(f"  round {r + 1}/{rounds}: " + "  ".join(f"{n} {v[-1]:.2f}" for n, v in times.items()))

    samplers = {name: functools.partial(sample, name) for name in TRAIN_CONFIGS}
    times = interleaved(samplers, rounds, after_round=each_round)
    med = {n: statistics.median(v) for n, v in times.items()}
    rounds_ms = {n: [round(x, 2) for x in v] for n, v in times.items()}
    return {
        "what": f"GPT-2 {cfg.n_layer} layers, width {cfg.n_embd}, batch {b}x{t}, AdamW, "
        f"{cfg._attn_implementation} attention" + (f", torch.compile (backend {backend})" if compiled else ", eager"),
        "samples": f"{rounds} rounds x {steps} steps",
        "ms": med,
        "vs_autocast": {n: med[n] / med["autocast"] for n in med},
        "vs_bf16": {n: med[n] / med["bf16"] for n in med},
        "peak_mib": peaks,
        "loss": losses,
        "logits_dtype": {n: "/".join(sorted(s["dtypes"])) for n, s in state.items()},
        "graphs_compiled_while_timed": recompiles,
        "rounds_ms": rounds_ms,
        "memory_by_round": memory,
    }


def _graphs():
    """Graphs torch.compile has made in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def decode_part(device, plan, size):
    models, cfg = decode.build(size, device)
    res = decode.measure(models, cfg.vocab_size, device, plan["new"], plan["d_rounds"], progress=log)
    params = sum(p.numel() for p in models["fp32"].parameters())
    res["what"] = (
        f"Llama {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size} ({params / 1e9:.2f}B parameters), "
        f"batch 1, prompt {decode.PROMPT}, {plan['new']} new tokens greedy with a KV cache"
    )
    return res


def markdown(meta, parts):
    L = [
        f"# hmp on {meta['device_name']}",
        "",
        f"- torch {meta['torch']}, transformers {meta['transformers']}, hmp {meta['hmp']} from `{meta['hmp_path']}`, "
        f"python {meta['python']}",
        f"- command: `{meta['command']}`; wall time {meta['wall_s']:.0f} s ({meta['part_s']})"
        + ("; **DRY RUN on the CPU: tiny sizes, the numbers measure nothing**" if meta["dry_run"] else ""),
        "- configurations interleaved round by round (order rotated), medians; hmp converted only for its own "
        "samples, outside the timed region; ratios are time / autocast's time (below 1: faster)",
        "",
    ]
    for key, title in (("train_eager", "Training step, eager"), ("train_compiled", "Training step, torch.compile")):
        r = parts.get(key)
        if r is None:
            continue
        L += [f"## {title}: {r['what']} ({r['samples']})", ""]
        L += [
            "| configuration | ms/step | vs autocast | vs bf16 | peak MiB | last loss | logits | graphs compiled "
            "while timed |",
            "|---|---:|---:|---:|---:|---:|---|---:|",
        ]
        for n, ms in r["ms"].items():
            L.append(
                f"| {n} | {ms:.2f} | {r['vs_autocast'][n]:.3f} | {r['vs_bf16'][n]:.3f} | {r['peak_mib'][n]:.0f} | "
                f"{r['loss'][n]:.4f} | {r['logits_dtype'][n]} | {r['graphs_compiled_while_timed'][n]} |"
            )
        L += ["", "Each round's ms/step (a trend across rounds: each round converts and reverts hmp once):", ""]
        L += [f"- {n}: " + ", ".join(f"{x:.2f}" for x in v) for n, v in r["rounds_ms"].items()]
        mem = {n: v for n, v in r["memory_by_round"].items() if any(v)}
        if mem:
            L += ["", "What the CUDA allocator holds after each round (torch.cuda.memory_stats()):", ""]
            for n, v in mem.items():
                first, last = v[0], v[-1]
                L.append(f"- {n}: " + ", ".join(f"{k} {first[k]} -> {last[k]}" for k in first))
        L.append("")
    r = parts.get("decode")
    if r is not None:
        L += [f"## Decode: {r['what']} ({r['rounds']} rounds)", "", decode.report(r), ""]
    r = parts.get("percall")
    if r is not None:
        L += [
            f"## Per call: {percall.SIZE}x{percall.SIZE} tensors, us added over bare torch ({meta['percall']})",
            "",
            percall.report(r),
            "",
            "| call | hmp added / autocast added |",
            "|---|---:|",
        ]
        for case, c in r.items():
            a = c["added_us"]
            ratio = a["hmp"] / a["autocast"] if a["autocast"] > 0 else float("nan")
            L.append(f"| {case} | {ratio:.2f} |")
        L.append("")
    return "\n".join(L)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: checks the code paths")
    ap.add_argument("--device", help="default: cuda, or cpu with --dry-run")
    ap.add_argument("--out", help="the markdown report (default on CUDA: benchmarks/RESULTS-cuda.md)")
    ap.add_argument("--parts", default="train,compile,decode,percall", help="comma list of the parts to run")
    ap.add_argument("--backend", help="torch.compile backend (default inductor; aot_eager with --dry-run)")
    ap.add_argument(
        "--cpu-sizes", action="store_true", help="GPT-2 2 x 256 on 4 x 128 tokens: the compiled-step ratio on a CPU"
    )
    args = ap.parse_args(argv)
    device = args.device or ("cpu" if args.dry_run else "cuda")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or check the script with --dry-run")
    out = args.out or (str(HERE / "RESULTS-cuda.md") if torch.device(device).type == "cuda" else None)
    size = "dry" if args.dry_run else "cpu" if args.cpu_sizes else "full"
    plan = PLAN[size]
    backend = args.backend or ("aot_eager" if args.dry_run else "inductor")
    parts_wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed cache argument
    warnings.filterwarnings("ignore", message="hmp: a torch.autocast region")  # percall enters one per sample
    if args.dry_run:
        torch.set_num_threads(1)

    import transformers

    wall = Stopwatch()
    meta = {
        "device_name": torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "CPU",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hmp": hmp.__version__,
        "hmp_path": str(Path(hmp.__file__).parent),
        "python": platform.python_version(),
        "command": " ".join(["benchmarks/gpu.py"] + (sys.argv[1:] if argv is None else list(argv))),
        "dry_run": args.dry_run,
        "percall": f"median over {plan['reps']} reps of {plan['calls']} calls",
    }
    parts, seconds = {}, {}
    for part in parts_wanted:
        log(f"[{part}] ({wall.elapsed:.0f} s)")
        in_part = Stopwatch()
        if part == "train":
            parts["train_eager"] = train(device, plan, size, False, backend)
        elif part == "compile":
            parts["train_compiled"] = train(device, plan, size, True, backend)
            torch._dynamo.reset()
        elif part == "decode":
            llama = LLAMA_DRY if args.dry_run else "proxy" if args.cpu_sizes else "tinyllama"
            parts["decode"] = decode_part(device, plan, llama)
        elif part == "percall":
            parts["percall"] = percall.run(plan["reps"], plan["calls"], progress=log, device=device)
        else:
            raise SystemExit(f"unknown part {part!r}: train, compile, decode, percall")
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        seconds[part] = in_part.elapsed
    meta["part_s"] = ", ".join(f"{p} {s:.0f} s" for p, s in seconds.items())
    meta["wall_s"] = wall.elapsed
    md = markdown(meta, parts)
    print(md)
    if out:
        Path(out).write_text(md + "\n")
        log(f"written: {out}")


# its quickest run that still goes through its code (tests/integration/test_benchmark_scripts.py)
QUICK = ("--dry-run",)


if __name__ == "__main__":
    main()
