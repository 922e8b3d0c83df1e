"""Wrapped calls per training step, and convert()'s time (issue 39); with
``--engines``, what still runs in hmp's Python on each engine (issue 78).

Counts the calls that enter hmp's wrapper body (each pays hmp's per-call
cost) in one training step of the demo's model and of a small Llama
(transformers, random init), under convert() with the default lists; and
times convert() + revert(). A count, not a time: the same on any machine.
Before the pointwise rule, run it with HMP_PURE_PYTHON=1 (the C body's calls
are invisible to a profile function).

``--engines``: per decode token of the proxy Llama (no_grad, one token with
the KV cache) and per training step of GPT-2 (the "dry" shape, AdamW), on
each engine, every entry into hmp's Python from outside it, by what it is:
a listed op's wrapper, the small wrapper that turns autocast off around an op
the lists leave to torch, a module entry, or a hook (an optimizer step's, a
backward's).

    python benchmarks/wrapped_calls.py [--json out.json] [--engines]
"""

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for p in (str(HERE), str(HERE.parent)):  # the sibling modules, and this checkout's hmp
    if p not in sys.path:
        sys.path.insert(0, p)

import workloads  # noqa: E402

import hmp  # noqa: E402
from hmp.core import wrap, wrapper_frames  # noqa: E402
from hmp.tools.timing import per_call  # noqa: E402


def count(step):
    """Calls of the wrapper body during ``step()``."""
    n = 0

    def profiler(frame, event, arg):
        nonlocal n
        if event == "call" and frame.f_code is wrap._BODY:
            n += 1

    sys.setprofile(profiler)
    try:
        step()
    finally:
        sys.setprofile(None)
    return n


def by_op(step):
    """Calls of the wrapper body during ``step()``, by the op each wraps (a Counter)."""
    calls = collections.Counter()

    def profiler(frame, event, arg):
        if event == "call" and frame.f_code is wrap._BODY:
            op = wrapper_frames.wrapper_op(frame)
            calls[getattr(op, "__name__", None) or repr(op)] += 1

    sys.setprofile(profiler)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


HMP_DIR = str(Path(hmp.__file__).resolve().parent)


def _entry(frame):
    """What an entry into hmp's Python is, by its code: a listed op's wrapper (and its op), the
    autocast-off wrapper (and its op), or the function's own name (module entries, hooks)."""
    code = frame.f_code
    if code is wrap._BODY:
        op = wrapper_frames.wrapper_op(frame)
        return "listed op: " + (getattr(op, "__name__", None) or repr(op))
    if code.co_name == "autocast_off":
        op = frame.f_locals.get("op")
        return "autocast off: " + (getattr(op, "__name__", None) or repr(op))
    return f"{code.co_name} ({Path(code.co_filename).stem})"


def entries(step):
    """Entries into hmp's Python from outside it during ``step()``, by what each is (a Counter)."""
    found = collections.Counter()

    def profiler(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(HMP_DIR):
            back = frame.f_back
            if back is None or not back.f_code.co_filename.startswith(HMP_DIR):
                found[_entry(frame)] += 1

    sys.setprofile(profiler)
    try:
        step()
    finally:
        sys.setprofile(None)
    return found


def llama_token():
    """One decode token of the proxy Llama (decode.py's CPU proxy), with the KV cache of an 8-token prefill."""
    model, _ = workloads.llama("proxy")
    model.eval()
    kw = workloads.cache_kw(model)
    prompt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    token = torch.zeros(1, 1, dtype=torch.long)

    def step():
        with torch.no_grad():
            cache = workloads.cache_of(model(input_ids=prompt, use_cache=True))
            yield
            model(input_ids=token, use_cache=True, **{kw: cache})

    return step


def gpt2_step():
    """One training step of GPT-2 ("dry" shape, sdpa attention, AdamW)."""
    model, _ = workloads.gpt2("dry")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))

    def step():
        yield
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def _counted(make):
    """``make()``'s step counted after its set-up (the step yields once where counting starts)."""
    run = make()
    gen = run()
    next(gen)
    return entries(lambda: next(gen, None))


def engines():
    """``{model: {engine: Counter of hmp entries}}`` per decode token (proxy Llama) and training step (GPT-2)."""
    out = {}
    for name, make in (("proxy Llama, per decode token", llama_token), ("GPT-2, per training step", gpt2_step)):
        out[name] = {}
        for engine in ("python", "autocast"):
            with hmp.converted(engine=engine):
                _counted(make)  # warm-up: lazy imports, first casts
                out[name][engine] = _counted(make)
    return out


def frames(call):
    """hmp's Python frames one ``call()`` runs (after a first, untimed call)."""
    call()
    n = 0

    def profiler(frame, event, arg):
        nonlocal n
        n += event == "call" and frame.f_code.co_filename.startswith(HMP_DIR)

    sys.setprofile(profiler)
    try:
        call()
    finally:
        sys.setprofile(None)
    return n


def _ops_left_in_python():
    """The calls a decode token or a training step still makes through hmp's Python (issue 78, item
    4), each beside the lean path of a listed op (``F.linear``, positional): ``{label: call}``."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 16, generator=g)
    rope = workloads.llama("tiny")[0].model.rotary_emb
    ids, pos = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    ln, x = torch.nn.LayerNorm(16), torch.randn(2, 16, generator=g)
    emb, w = torch.nn.Embedding(32, 16), torch.randn(16, 16, generator=g)
    sdpa = F.scaled_dot_product_attention
    return {
        "F.linear (the lean path)": lambda: F.linear(x, w),
        "sdpa, keywords (transformers' call)": lambda: sdpa(q, q, q, attn_mask=None, is_causal=False),
        "embedding (FP32 list)": lambda: emb(ids),
        "layer_norm (one dtype)": lambda: ln(x),
        "rotary embedding (FP32 module entry)": lambda: rope(q, pos),
    }


def left_in_python():
    """``{engine: {label: hmp frames per call}}`` for ``_ops_left_in_python``'s calls, under no_grad."""
    out = {}
    for engine in ("python", "autocast"):
        with hmp.converted(engine=engine), torch.no_grad():
            out[engine] = {label: frames(call) for label, call in _ops_left_in_python().items()}
    return out


def demo_step():
    from hmp.demo import data, training

    cfg = training.Config()
    model, opt, sched = training.build(cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, data.VOCAB, (cfg.batch_size, cfg.seq_len), generator=g)
    y = torch.randint(0, data.VOCAB, (cfg.batch_size, cfg.seq_len), generator=g)
    return lambda: training.train_step(model, opt, sched, x, y, cfg)


def llama_step():
    # decode.py's CPU proxy at 128 positions, in transformers' default attention (the counts were taken so)
    model, _ = workloads.llama("tiny", attn=None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def _convert_revert():
    hmp.convert()
    hmp.revert()


def convert_ms(reps=9):
    return statistics.median(per_call(_convert_revert) * 1e3 for _ in range(reps))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the numbers here")
    parser.add_argument("--engines", action="store_true", help="only what runs in hmp's Python on each engine")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.engines:
        return _print_engines(engines(), left_in_python(), args.json)
    out = {}
    for name, make in (("demo model", demo_step), ("small Llama", llama_step)):
        step = make()
        with hmp.converted():
            step()  # warm-up: lazy imports, first casts
            out[name] = count(step)
    out["convert+revert ms"] = round(convert_ms(), 1)
    for key, value in out.items():
        print(f"{key:>20}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def _print_engines(found, frames_per_call, path):
    print("hmp frames per call, no_grad: " + ", ".join(frames_per_call))
    for label in frames_per_call["python"]:
        print(f"  {label:40s} " + " / ".join(str(f[label]) for f in frames_per_call.values()))
    for name, by_engine in found.items():
        print(f"{name}:")
        for engine, counts in by_engine.items():
            listed = sum(n for k, n in counts.items() if k.startswith(("listed op", "autocast off")))
            print(f"  engine={engine}: {sum(counts.values())} entries, {listed} of them listed or autocast-off ops")
            for key, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
                print(f"    {n:4d}  {key}")
    if path:
        with open(path, "w") as f:
            counts = {m: {e: dict(c) for e, c in by.items()} for m, by in found.items()}
            json.dump({"entries": counts, "frames per call": frames_per_call}, f, indent=1)


# its quickest run that still goes through its code (tests/integration/test_benchmark_scripts.py)
QUICK = ()


if __name__ == "__main__":
    main()
