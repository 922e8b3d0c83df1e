"""What each of hmp's engines costs on the CPU, against float32 and torch.autocast (docs/engines.md).

    python benchmarks/engines.py [--reps 21] [--calls 200] [--json out.json]

Modes: ``bare`` (float32, torch's own), ``autocast`` (a ``torch.autocast("cpu", bfloat16)`` region),
``hmp`` (``convert()``, the Python engine) and ``hmp engine=autocast`` (``convert(engine="autocast")``).
Cases: ``F.linear`` on 8x8 tensors in a training forward and under ``no_grad`` (the per-call cost:
the kernels are tiny), and a 2-block transformer (d=64, 16 tokens, batch 2: linear, matmul, softmax,
layer_norm, gelu) forward under ``no_grad`` and training step (forward and backward). Per rep each mode
takes one sample of ``calls`` calls, entered fresh (its conversion or region set up outside the clock),
the modes' order rotated each rep; a mode's ratio is the median over reps of its sample over that rep's
autocast sample. And a decode: the proxy Llama of benchmarks/workloads.py (hidden 64, 4 layers) under
``no_grad``, one call a prefill of 8 tokens and 8 tokens more with the KV cache, as ``generate()`` runs
it (taken ``calls / 50`` times per sample). Also counted: hmp's Python frames per call
(``sys.setprofile``, frames whose code lives under hmp/), deterministic.
"""

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # workloads.py, beside this file

import hmp  # noqa: E402
from hmp.tools.timing import per_call, rotated  # noqa: E402

MODES = ("bare", "autocast", "hmp", "hmp engine=autocast")
HMP_DIR = os.path.dirname(os.path.abspath(hmp.__file__))


class Block(nn.Module):
    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (s.reshape(b, t, self.heads, -1).transpose(1, 2) for s in self.qkv(self.ln1(x)).split(d, -1))
        a = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, -1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def cases():
    """case -> (grad mode, the call)."""
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    with torch.enable_grad():
        h = torch.randn(8, 8, requires_grad=True) * 1.0  # an activation inside a training forward
    w, b = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8))
    model, tokens = nn.Sequential(Block(), Block()), torch.randn(2, 16, 64)

    def step():
        model(tokens).float().square().mean().backward()

    return {
        "decode 8 tokens (proxy Llama)": (False, decoder()),
        "F.linear (training)": (True, lambda: F.linear(h, w, b)),
        "F.linear (no_grad)": (False, lambda: F.linear(x, w, b)),
        "2-block forward (no_grad)": (False, lambda: model(tokens)),
        "2-block training step": (True, step),
    }


def decoder():
    """One call: a prefill of 8 tokens, then 8 tokens fed back with the KV cache (transformers' names)."""
    import workloads

    model, _ = workloads.llama("proxy")
    model.eval()
    prompt, token = torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    kw = workloads.cache_kw(model)

    def decode():
        out = model(input_ids=prompt, use_cache=True)
        for _ in range(8):
            out = model(input_ids=token, use_cache=True, **{kw: workloads.cache_of(out)})
        return out.logits

    return decode


@contextlib.contextmanager
def mode(name, grad):
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(grad))
        if name == "autocast":
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        elif name.startswith("hmp"):
            stack.enter_context(hmp.converted(engine="autocast" if "engine" in name else "python"))
        yield


def hmp_frames(fn):
    """hmp's Python frames one call of ``fn`` runs (its second call: nothing lazy left)."""
    seen = []

    def profile(frame, event, arg):
        if event == "call" and os.path.abspath(frame.f_code.co_filename).startswith(HMP_DIR):
            seen.append(frame)

    fn()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return len(seen)


def run(reps, calls, progress=print):
    table = cases()
    samples = {c: {m: [] for m in MODES} for c in table}
    frames, dtypes = {c: {} for c in table}, {c: {} for c in table}
    for case, (grad, fn) in table.items():  # warm-up, what each mode returns, frames
        for m in MODES:
            with mode(m, grad):
                for _ in range(20):
                    out = fn()
                dtypes[case][m] = str(out.dtype).replace("torch.", "") if isinstance(out, torch.Tensor) else "-"
                if m.startswith("hmp"):
                    frames[case][m] = hmp_frames(fn)
    for rep in range(reps):
        for case, (grad, fn) in table.items():
            for m in rotated(MODES, rep):
                gc.collect()
                with mode(m, grad):
                    fn()
                    n = max(1, calls // 50) if case.startswith("decode") else calls
                    samples[case][m].append(per_call(fn, n) * 1e6)
        progress(f"rep {rep + 1}/{reps}")
    result = {}
    for case, per_mode in samples.items():
        ratio = {m: statistics.median(s / a for s, a in zip(v, per_mode["autocast"])) for m, v in per_mode.items()}
        result[case] = {
            "median_us": {m: statistics.median(v) for m, v in per_mode.items()},
            "over_autocast": ratio,
            "hmp_frames_per_call": frames[case],
            "dtype": dtypes[case],
        }
    return result


def report(result):
    lines = [
        "| case | bare us | autocast us | hmp us (x autocast) | engine=autocast us (x autocast) "
        "| hmp frames: python / autocast |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for case, r in result.items():
        us, x, fr = r["median_us"], r["over_autocast"], r["hmp_frames_per_call"]
        e = "hmp engine=autocast"
        lines.append(
            f"| {case} | {us['bare']:.1f} | {us['autocast']:.1f} | {us['hmp']:.1f} ({x['hmp']:.2f}) | "
            f"{us[e]:.1f} ({x[e]:.2f}) | {fr['hmp']} / {fr[e]} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="hmp:")
    result = run(args.reps, args.calls, progress=lambda said: None)
    print(
        f"torch {torch.__version__}, CPU, one thread: median over {args.reps} reps of interleaved samples of "
        f"{args.calls} calls; (x autocast): the median over reps of the sample over that rep's autocast one"
    )
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


# its quickest run that still goes through its code (tests/integration/test_benchmark_scripts.py)
QUICK = ("--reps", "1", "--calls", "2")


if __name__ == "__main__":
    main()
