"""Batch-1 greedy decode with a KV cache: fp32, autocast, the floor, hmp O1 (plain
and inside ``hmp.frozen_weights()``) and a pure-bf16 model (issues 40, 48); and
the same compiled with torch.compile.

    python benchmarks/decode.py [--tokens 64] [--rounds 15] [--json out.json]
    python benchmarks/decode.py --compiled     # also: compiled fp32, autocast, hmp O1 and bf16, interleaved
    python benchmarks/decode.py --quick        # a few tokens: checks the script, measures nothing
    python benchmarks/decode.py --profile hmp-O1-frozen   # where a token's time goes, by function

The CPU proxy of GPU decode: a tiny Llama (hidden 64, 4 layers, random
init, nothing downloaded) on one thread, where a token's time is almost all
per-call overhead, as batch-1 decode on a GPU is launch- and host-bound.
Configurations interleave round by round (the order rotated each round);
hmp is converted for its own samples only and reverted before the next
configuration, outside the timed region; each sample is one ``torch.no_grad()``
block entered after the conversion, as ``model.generate()`` is one. A sample
is the prefill plus the decode steps, divided by the tokens generated.
Medians over rounds.

The floor (benchmarks/floor.py) is the smallest Python wrapper with hmp's casts
at hmp's sites: its ratio to autocast bounds what any per-call Python wrapper
can reach on this workload.

Compiled (``--compiled``): ``torch.compile`` of each configuration's model
(``mode="reduce-overhead"`` on CUDA; on a CPU, where it has no CUDA graphs to
use, the default mode), hmp converted for the whole phase and the other
configurations inside ``hmp.disable_casts()``, so no conversion changes what a
compiled graph's guards read; warmed up until nothing compiles, and every
graph compiled while timed counted. Every configuration's decode calls the
compiled model through ``step``: ``torch.compiler.cudagraph_mark_step_begin()``
before each call, and the outputs the loop keeps past the next call (the
next-token logits, the KV cache's tensors) cloned, for CUDA graphs overwrite
their outputs at the next replay (a no-op mark and a few clones on a CPU).
The target, on a GPU: compiled hmp O1 at most 1.05x compiled autocast's time
per token (``COMPILED_TARGETS``; reported PASS or FAIL, not asserted).

It also counts the calls that enter hmp's wrapper per token (every
configuration: fp32, autocast and bf16 must count none) and divides hmp's
time over autocast's (and over pure bf16's) by them: what each wrapped call
costs. The module is device-agnostic; benchmarks/gpu.py runs it on CUDA
with TinyLlama's shape.
"""

import argparse
import contextlib
import copy
import cProfile
import functools
import gc
import json
import pstats
import statistics
import sys
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for p in (str(HERE), str(HERE.parent)):  # the sibling modules, and this checkout's hmp
    if p not in sys.path:
        sys.path.insert(0, p)

import floor  # noqa: E402
import workloads  # noqa: E402
import wrapped_calls  # noqa: E402

import hmp  # noqa: E402
from hmp.tools.launches import count  # noqa: E402
from hmp.tools.timing import interleaved, iqr_rel, per_call  # noqa: E402

CONFIGS = ("fp32", "autocast", "floor", "hmp-O1", "hmp-O1-frozen", "bf16")
COMPILED = ("fp32", "autocast", "hmp-O1", "bf16")
# (numerator, denominator, at most): the issues' decode targets
TARGETS = (
    ("hmp-O1", "autocast", 1.25),
    ("hmp-O1-frozen", "autocast", 1.15),
    ("hmp-O1-frozen", "hmp-O1", 1.00),  # frozen_weights() never slower than without it
)
COMPILED_TARGETS = (("hmp-O1", "autocast", 1.05),)
PROMPT = 8


def sync(device):
    """Wait for queued kernels where the device queues them (CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def build(size, device):
    """fp32 and pure-bf16 copies of one randomly initialised Llama (workloads.llama: ``size`` a
    workloads.LLAMA key, "proxy" or "tinyllama", or a dict of its fields), in eval()."""
    fp32, cfg = workloads.llama(size, device)
    fp32.eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)  # same weights, rounded
    return {"fp32": fp32, "bf16": bf16}, cfg


@contextlib.contextmanager
def active(name, device):
    """The configuration ``name`` for a block. hmp is converted only for its
    own configurations and reverted on exit: every block finds it reverted,
    or refuses to run."""
    if hmp.is_converted():
        raise RuntimeError(f"{name}: hmp converted on entry (a block before did not revert)")
    with contextlib.ExitStack() as stack:
        if name.startswith("hmp"):  # converted first: the no-grad block is then one hmp sees
            stack.enter_context(hmp.converted(opt_level="O1"))
            if name.endswith("frozen"):
                stack.enter_context(hmp.frozen_weights())
        elif name == "floor":
            stack.enter_context(floor.installed(opt_level="O1"))
        stack.enter_context(torch.no_grad())
        if name == "autocast":
            stack.enter_context(torch.autocast(torch.device(device).type, dtype=torch.bfloat16))
        if hmp.is_converted() != name.startswith("hmp"):
            raise RuntimeError(f"{name}: hmp converted={hmp.is_converted()} inside its block")
        yield
    if hmp.is_converted():
        raise RuntimeError(f"{name}: hmp still converted after its block")


def model_for(models, name):
    return models["bf16" if name == "bf16" else "fp32"]


def _clone_cache(cache):
    """Replace every tensor the KV cache holds by a clone, in place on the cache object (transformers
    >= 4.56: ``cache.layers``, each layer's tensors its attributes). Raises where it finds none: a cache
    laid out otherwise would keep the call's outputs unnoticed."""
    found = 0
    for layer in getattr(cache, "layers", ()):
        for attr, value in list(vars(layer).items()):
            if isinstance(value, torch.Tensor):
                setattr(layer, attr, value.clone())
                found += 1
    if not found:
        raise RuntimeError(f"no tensor found to clone in the KV cache {type(cache).__name__}")


def step(model, marked, **inputs):
    """One call of the decode: ``(next-token logits, KV cache)``. ``marked`` (the compiled phase, every
    configuration alike): ``torch.compiler.cudagraph_mark_step_begin()`` before the call, and what the
    loop keeps past the next call, the next-token logits and the cache's tensors, cloned out of the
    call's outputs. Under ``mode="reduce-overhead"`` on CUDA the outputs live in CUDA graphs' memory,
    which the next replay overwrites ("accessing tensor output of CUDAGraphs that has been overwritten
    by a subsequent run", as transformers' generate() loop met it); on a CPU the mark does nothing and
    the clones cost every configuration the same."""
    if marked:
        torch.compiler.cudagraph_mark_step_begin()
    out = model(use_cache=True, **inputs)
    logits, cache = out.logits[:, -1:], workloads.cache_of(out)
    if marked:
        logits = logits.clone()
        _clone_cache(cache)
    return logits, cache


def generate(model, prompt, new, marked=False):
    """Greedy decode of ``new`` tokens: the prefill gives the first, then one
    call per token with the KV cache. Returns (tokens, logits dtype).
    ``marked``: each call a step of its own, its kept outputs cloned (``step``)."""
    kw = workloads.cache_kw(model)
    logits, cache = step(model, marked, input_ids=prompt)
    tok = logits.argmax(-1)
    toks = [tok]
    for _ in range(new - 1):
        logits, cache = step(model, marked, input_ids=tok, **{kw: cache})
        tok = logits.argmax(-1)
        toks.append(tok)
    return torch.cat(toks, 1)[0].tolist(), logits.dtype


def _steps(model, prompt, new):
    """The decode's calls with token 0 fed back (what a token costs, not which): runs on meta tensors."""
    kw = workloads.cache_kw(model)
    out = model(input_ids=prompt, use_cache=True)
    tok = torch.zeros(1, 1, dtype=torch.long, device=prompt.device)
    for _ in range(new):
        out = model(input_ids=tok, use_cache=True, **{kw: workloads.cache_of(out)})


def kernels_added_per_token(models, name, prompt, device, tokens=4):
    """GPU kernel launches per token a configuration adds over fp32 (hmp.tools.launches), counted
    where nothing needs a GPU: on CUDA the run's own tensors; on a CPU, hmp and the floor on a
    meta copy of the model (their off-CPU paths, as on CUDA), autocast and bf16 on the CPU
    (autocast cannot run on meta), each beside fp32 on the same device, so the difference is
    the configuration's own. On meta, sdpa with bf16 inputs runs its math decomposition, whose
    upcasts are counted (five per call); on CUDA it is one fused kernel: the estimate is high there."""
    on = device if torch.device(device).type == "cuda" or name in ("fp32", "autocast", "bf16") else "meta"
    # the meta copy lives for this count only: kept, its objects would slow the timed runs' collections
    meta = copy.deepcopy(models["fp32"]).to("meta") if on == "meta" else None
    model = meta if meta is not None else model_for(models, name)
    base = meta if meta is not None else models["fp32"]
    p = torch.zeros(prompt.shape, dtype=prompt.dtype, device="meta") if meta is not None else prompt
    try:
        with active("fp32", on):
            plain = count(_steps, base, p, tokens).kernels
        with active(name, on):
            mine = count(_steps, model, p, tokens).kernels
    except RuntimeError:  # torch < 2.5 refuses autocast(device_type="meta"), which the rotary embedding enters
        if meta is None:
            raise
        plain = mine = float("nan")
    del meta, model, base
    gc.collect()
    return (mine - plain) / tokens


def sample(models, name, prompt, new, device):
    """ms per token of one decode in configuration ``name``."""
    model = model_for(models, name)
    gc.collect()
    with active(name, device):
        dt = per_call(lambda: generate(model, prompt, new), sync=functools.partial(sync, device))
    return dt / new * 1e3


def describe(models, name, prompt, new, device):
    """What a configuration does, untimed: tokens, logits dtype, wrapped
    calls per token (counted over at most 16 tokens: the profile hook is slow)."""
    model = model_for(models, name)
    with active(name, device):
        got = {}

        got["tokens"], got["dtype"] = generate(model, prompt, new)
        counted = min(new, 16)
        calls = wrapped_calls.by_op(lambda: generate(model, prompt, counted))
    return {
        "tokens": got["tokens"],
        "logits_dtype": str(got["dtype"]).replace("torch.", ""),
        "wrapped_per_token": sum(calls.values()) / counted,
        "wrapped_by_op_per_token": {op: n / counted for op, n in calls.most_common()},
    }


def measure(models, vocab, device, new, rounds, names=CONFIGS, progress=None):
    """Warm-up and description per configuration, then ``rounds`` interleaved samples each."""
    prompt = torch.randint(0, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(2)).to(device)
    info = {}
    for name in names:
        sample(models, name, prompt, new, device)  # warm-up: lazy imports, first casts, allocator
        info[name] = describe(models, name, prompt, new, device)
    samplers = {name: functools.partial(sample, models, name, prompt, new, device) for name in names}
    times = interleaved(samplers, rounds, after_round=_each_round(progress, "round", rounds))
    for name in names:  # after the timed rounds: counting before them slowed them (a meta copy, a dispatch mode)
        info[name]["kernels_added_per_token"] = kernels_added_per_token(models, name, prompt, device)
    return summarize(times, info, new)


def _each_round(progress, what, rounds):
    """interleaved()'s after_round: ``{what} r/rounds: name ms ...`` to ``progress`` (None: nothing)."""
    if progress is None:
        return None
    return lambda r, times: progress(
        f"{what} {r + 1}/{rounds}: " + "  ".join(f"{n} {t[-1]:.3f}" for n, t in times.items())
    )


def summarize(times, info, new):
    med = {n: statistics.median(t) for n, t in times.items()}
    res = {
        "tokens": new,
        "rounds": len(next(iter(times.values()))),
        "ms_per_token": med,
        "samples_ms": times,
        "iqr_rel": {n: iqr_rel(t) for n, t in times.items()},
        "vs_autocast": {n: med[n] / med["autocast"] for n in med} if "autocast" in med else {},
        "configs": info,
    }
    if "autocast" in info:  # share of tokens equal to autocast's: bf16 schemes may differ on a random model
        ref = info["autocast"]["tokens"]
        for i in info.values():
            i["same_tokens_as_autocast"] = sum(a == b for a, b in zip(i["tokens"], ref)) / len(ref)
    per_call = {}
    for h in ("hmp-O1", "hmp-O1-frozen"):
        calls = info.get(h, {}).get("wrapped_per_token")
        if calls:
            per_call[h] = {
                ref: (med[h] - med[ref]) * 1e3 / calls for ref in ("autocast", "floor", "bf16") if ref in med
            }
    res["per_wrapped_call"] = per_call
    res["targets"] = [
        {"ratio": f"{a} / {b}", "limit": lim, "value": med[a] / med[b], "pass": med[a] / med[b] <= lim}
        for a, b, lim in TARGETS
        if a in med and b in med
    ]
    return res


def compile_mode(device):
    """``mode="reduce-overhead"`` (CUDA graphs) on CUDA; the default on a CPU, which has none."""
    return "reduce-overhead" if torch.device(device).type == "cuda" else None


@contextlib.contextmanager
def compiled_active(name, device):
    """A compiled configuration's block, inside the phase's one conversion: casts off but for hmp's."""
    with contextlib.ExitStack() as stack:
        if not name.startswith("hmp"):
            stack.enter_context(hmp.disable_casts())
        stack.enter_context(torch.no_grad())
        if name == "autocast":
            stack.enter_context(torch.autocast(torch.device(device).type, dtype=torch.bfloat16))
        yield


def _graphs():
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def measure_compiled(models, vocab, device, new, rounds, names=COMPILED, progress=None):
    """Each configuration's model compiled (``compile_mode``), warmed up until a decode compiles
    nothing, then ``rounds`` interleaved samples each; graphs compiled while timed are counted.
    dynamo's recompile limit is raised for the call only (four configurations share the model's
    code; the limit has two names across releases, one an alias of the other)."""
    import torch._dynamo

    config = torch._dynamo.config
    with config.patch({key: 64 for key in ("cache_size_limit", "recompile_limit") if hasattr(config, key)}):
        return _measure_compiled(models, vocab, device, new, rounds, names, progress)


def _measure_compiled(models, vocab, device, new, rounds, names, progress):
    prompt = torch.randint(0, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(2)).to(device)
    mode = compile_mode(device)
    info, recompiles = {}, dict.fromkeys(names, 0)
    with hmp.converted(opt_level="O1"):
        compiled = {n: torch.compile(model_for(models, n), mode=mode) for n in names}

        def sample(name):
            gc.collect()
            with compiled_active(name, device):
                dt = per_call(
                    lambda: generate(compiled[name], prompt, new, marked=True), sync=functools.partial(sync, device)
                )
            return dt / new * 1e3

        def timed(name):
            before = _graphs()
            ms = sample(name)
            recompiles[name] += _graphs() - before
            return ms

        for name in names:
            for _ in range(4):  # the prefill, the first decode step, then dynamic shapes
                before = _graphs()
                sample(name)
                if _graphs() == before:
                    break
            with compiled_active(name, device):
                tokens, dtype = generate(compiled[name], prompt, new, marked=True)
            info[name] = {"tokens": tokens, "logits_dtype": str(dtype).replace("torch.", "")}
        samplers = {name: functools.partial(timed, name) for name in names}
        times = interleaved(samplers, rounds, after_round=_each_round(progress, "compiled round", rounds))
    med = {n: statistics.median(t) for n, t in times.items()}
    return {
        "mode": mode or "default",
        "rounds": rounds,
        "ms_per_token": med,
        "samples_ms": times,
        "iqr_rel": {n: iqr_rel(t) for n, t in times.items()},
        "vs_autocast": {n: med[n] / med["autocast"] for n in med} if "autocast" in med else {},
        "graphs_compiled_while_timed": recompiles,
        "configs": info,
        "targets": [
            {"ratio": f"{a} / {b}", "limit": lim, "value": med[a] / med[b], "pass": med[a] / med[b] <= lim}
            for a, b, lim in COMPILED_TARGETS
            if a in med and b in med
        ],
    }


def report_compiled(res):
    lines = [
        f"compiled (torch.compile, mode {res['mode']}):",
        "| configuration | ms/token | vs autocast | IQR/median | graphs compiled while timed | logits |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for n, ms in res["ms_per_token"].items():
        lines.append(
            f"| {n} | {ms:.3f} | {res['vs_autocast'].get(n, float('nan')):.3f} | {res['iqr_rel'][n]:.2f} | "
            f"{res['graphs_compiled_while_timed'][n]} | {res['configs'][n]['logits_dtype']} |"
        )
    for t in res["targets"]:
        lines.append(f"- target {t['ratio']} <= {t['limit']:.2f}: {t['value']:.3f} {'PASS' if t['pass'] else 'FAIL'}")
    return "\n".join(lines)


def profile(models, name, vocab, device, new, top=15):
    """cProfile of one decode in configuration ``name``: the ``top`` functions
    by own time, per token. cProfile inflates Python-heavy code: compare
    configurations with it, not with the timed samples."""
    model = model_for(models, name)
    prompt = torch.randint(0, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(2)).to(device)
    with active(name, device):
        generate(model, prompt, new)  # warm-up
        prof = cProfile.Profile()
        prof.runcall(generate, model, prompt, new)
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (primitive calls, calls, own, cumulative, callers)
    total = sum(v[2] for v in stats.values())
    rows = sorted(((v[2], v[1], f"{Path(k[0]).name}:{k[2]}") for k, v in stats.items()), reverse=True)[:top]
    lines = [
        f"{name}: {total / new * 1e6:.0f} us per token under cProfile",
        "| function | calls/token | own us/token |",
        "|---|---:|---:|",
    ]
    lines += [f"| {fn} | {n / new:.1f} | {tt / new * 1e6:.1f} |" for tt, n, fn in rows]
    return "\n".join(lines)


def report(res):
    lines = [
        "| configuration | ms/token | vs autocast | IQR/median | wrapped calls/token | logits | tokens = autocast's "
        "| GPU kernels/token added over fp32 |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for n, ms in res["ms_per_token"].items():
        i = res["configs"][n]
        same = i.get("same_tokens_as_autocast", float("nan"))
        lines.append(
            f"| {n} | {ms:.3f} | {res['vs_autocast'].get(n, float('nan')):.3f} | {res['iqr_rel'][n]:.2f} | "
            f"{i['wrapped_per_token']:.0f} | {i['logits_dtype']} | {same:.2f} | "
            f"{i.get('kernels_added_per_token', float('nan')):+.0f} |"
        )
    lines.append("")
    if "floor" in res["vs_autocast"]:
        bound = res["vs_autocast"]["floor"]
        lines.append(f"- the floor's own ratio to autocast (the bound for a Python wrapper): {bound:.3f}")
    for h, d in res["per_wrapped_call"].items():
        lines.append(f"- {h}: " + ", ".join(f"{v:+.2f} us per wrapped call over {ref}" for ref, v in d.items()))
    hmp_ops = res["configs"].get("hmp-O1", {}).get("wrapped_by_op_per_token", {})
    if hmp_ops:
        lines.append("- hmp-O1's wrapped calls per token: " + ", ".join(f"{op} {n:.0f}" for op, n in hmp_ops.items()))
    for t in res["targets"]:
        lines.append(f"- target {t['ratio']} <= {t['limit']:.2f}: {t['value']:.3f} {'PASS' if t['pass'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per sample (default 64)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved samples per configuration (default 15)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="4 tokens, 2 rounds: checks the script, measures nothing")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--profile", metavar="CONFIG", action="append", help="cProfile CONFIG's decode instead")
    ap.add_argument("--compiled", action="store_true", help="also compiled fp32, autocast, hmp O1, bf16")
    ap.add_argument("--only-compiled", action="store_true", help="the compiled phase alone")
    ap.add_argument("--layers", type=int, help="decoder layers of the proxy (default 4; fewer compile faster)")
    ap.add_argument(
        "--compiled-configs",
        default=",".join(COMPILED),
        help=f"the compiled phase's configurations, a comma list (default {','.join(COMPILED)})",
    )
    args = ap.parse_args(argv)
    new, rounds = (4, 2) if args.quick else (args.tokens, args.rounds)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed cache argument
    size = dict(workloads.LLAMA["proxy"], **({"num_hidden_layers": args.layers} if args.layers else {}))
    models, cfg = build(size, args.device)
    if args.profile:
        for name in args.profile:
            print(profile(models, name, cfg.vocab_size, args.device, new), end="\n\n")
        return
    print(
        f"torch {torch.__version__}, {args.device}, one thread; Llama {cfg.num_hidden_layers} layers, hidden "
        f"{cfg.hidden_size}, vocab {cfg.vocab_size}; batch 1, prompt {PROMPT}, {new} new tokens greedy; "
        f"median of {rounds} interleaved rounds",
        flush=True,
    )
    res = {}
    if not args.only_compiled:
        res = measure(models, cfg.vocab_size, args.device, new, rounds, progress=lambda m: print(m, file=sys.stderr))
        print(report(res), flush=True)
    if args.compiled or args.only_compiled:
        names = tuple(n for n in args.compiled_configs.split(",") if n)
        unknown = [n for n in names if n not in COMPILED]
        if unknown:
            ap.error(f"--compiled-configs: unknown {unknown}; choose from {','.join(COMPILED)}")
        res["compiled"] = measure_compiled(
            models, cfg.vocab_size, args.device, new, rounds, names, progress=lambda m: print(m, file=sys.stderr)
        )
        print(report_compiled(res["compiled"]))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


# its quickest run that still goes through its code (tests/integration/test_benchmark_scripts.py)
QUICK = ("--quick",)


if __name__ == "__main__":
    main()
