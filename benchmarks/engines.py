"""What each of hmp's engines costs on the CPU, against float32 and torch.autocast (docs/engines.md).

    python benchmarks/engines.py [--reps 21] [--calls 200] [--json out.json]

Modes: ``bare`` (float32, torch's own), ``autocast`` (torch.autocast("cpu", bfloat16)), ``hmp``
(``convert()``, the Python engine) and ``hmp engine=autocast`` (``convert(engine="autocast")``).

Cases, each with the region a user puts torch.autocast in:

- ``F.linear`` on 8x8 tensors in a training forward and under ``no_grad`` (the per-call cost: the
  kernels are tiny), and a 2-block transformer (d=64, 16 tokens, batch 2: linear, matmul, softmax,
  layer_norm, gelu) forward under ``no_grad``: one autocast region around each sample.
- A decode of the proxy Llama of benchmarks/workloads.py (hidden 64, 4 layers) under ``no_grad``, its
  weights requiring grad (as ``from_pretrained`` leaves them) and frozen (``requires_grad_(False)``):
  one call a prefill of 8 tokens and 8 tokens with the KV cache, as ``generate()`` runs it, an
  autocast region around the call.
- A training step of the 2-block model (forward, backward, SGD step), and 4 micro-batches of it per
  SGD step, inside ``hmp.accumulation()`` under hmp: an autocast region around each forward.

Per rep each mode takes one sample of ``calls`` calls (``calls / 50`` for a decode, ``calls / 10``
for a training step, ``calls / 40`` for 4 micro-batches), entered fresh (its conversion set up
outside the clock), the modes' order rotated each rep. Each sample reads the wall clock and the
calling thread's CPU time (one torch thread: torch's work is this thread's); a mode's ratio is the
median over reps of its sample over that rep's autocast sample, for each clock. On a host other
processes load, the CPU-time ratio leaves out the time the thread waited for a core.

Counted, deterministic, per unit (a call; a decode token, after the prefill; a step): the casts
between floating dtypes a dispatch mode sees, and hmp's Python frames (``sys.setprofile``, frames
whose code lives under hmp/).
"""

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import sys
import warnings
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # workloads.py, beside this file

import hmp  # noqa: E402
from hmp.binding.aten import dispatched  # noqa: E402
from hmp.tools.timing import per_call_wall_and_thread, rotated  # noqa: E402

MODES = ("bare", "autocast", "hmp", "hmp engine=autocast")
HMP_MODES = MODES[2:]
HMP_DIR = os.path.dirname(os.path.abspath(hmp.__file__))
MICRO_BATCHES = 4


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


class Mode(NamedTuple):
    """What a case's call is given: ``region()``, the torch.autocast region the autocast mode puts
    around a forward (nothing in the others), and ``accumulation()``, hmp's block in the hmp modes."""

    region: Callable
    accumulation: Callable


class Case(NamedTuple):
    grad: bool  # grad mode of the sample
    call: Callable  # call(mode): one timed call
    unit: Callable  # unit(mode): what is counted once (a call, a decode token, a step)
    per_sample: int  # divides --calls: the calls of one sample
    whole: bool  # the autocast mode's region around the whole sample (else the call puts it in)
    unit_name: str = "call"


def cases():
    """case name -> Case."""
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    with torch.enable_grad():
        h = torch.randn(8, 8, requires_grad=True) * 1.0  # an activation inside a training forward
    w, b = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8))
    model, tokens = nn.Sequential(Block(), Block()), torch.randn(2, 16, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    micro = list(tokens.split(1))  # 2 samples: 2 micro-batches, twice

    def step(mode, batches=(tokens,)):
        for batch in batches:
            with mode.region():
                loss = model(batch).float().square().mean()
            loss.backward()
        opt.step()
        opt.zero_grad()

    def accumulated(mode):
        with mode.accumulation():
            step(mode, micro * (MICRO_BATCHES // len(micro)))

    table = {}
    for frozen in (False, True):
        prefill, token = decoder(frozen)
        table[f"decode 8 tokens (proxy Llama, {'frozen' if frozen else 'requires_grad'})"] = Case(
            False, prefill_and_8(prefill, token), one_token(prefill, token), 50, True, "token"
        )
    table.update(
        {
            "F.linear (training)": Case(True, lambda mode: F.linear(h, w, b), lambda mode: F.linear(h, w, b), 1, True),
            "F.linear (no_grad)": Case(False, lambda mode: F.linear(x, w, b), lambda mode: F.linear(x, w, b), 1, True),
            "2-block forward (no_grad)": Case(False, lambda mode: model(tokens), lambda mode: model(tokens), 1, True),
            "2-block training step": Case(True, step, step, 10, False, "step"),
            f"2-block, {MICRO_BATCHES} micro-batches per step": Case(True, accumulated, accumulated, 40, False, "step"),
        }
    )
    return table


def decoder(frozen):
    """``(prefill, token)``: the proxy Llama's prefill of 8 tokens, and one token fed back with the KV
    cache a call returned (transformers' names)."""
    import workloads

    model, _ = workloads.llama("proxy")
    model.eval().requires_grad_(not frozen)
    prompt, one = torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    kw = workloads.cache_kw(model)

    def prefill():
        return model(input_ids=prompt, use_cache=True)

    def token(out):
        return model(input_ids=one, use_cache=True, **{kw: workloads.cache_of(out)})

    return prefill, token


def prefill_and_8(prefill, token):
    def decode(mode):
        out = prefill()
        for _ in range(8):
            out = token(out)
        return out.logits

    return decode


def one_token(prefill, token):
    """A token after a prefill: the prefill is left out of what is counted."""

    def counted(mode):
        out = prefill()
        return lambda: token(out).logits

    return counted


@contextlib.contextmanager
def mode(name, grad, whole):
    """The mode for a sample: its grad mode, its conversion, and the autocast region around the sample
    (``whole``) or what its calls put around each forward."""
    region = accumulation = contextlib.nullcontext
    with contextlib.ExitStack() as stack:
        if name in HMP_MODES:  # converted first, as a script converts before its loops: the grad block is a region
            stack.enter_context(hmp.converted(engine="autocast" if "engine" in name else "python"))
            accumulation = hmp.accumulation
        stack.enter_context(torch.set_grad_enabled(grad))
        if name == "autocast":
            if whole:
                stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            else:
                region = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
        yield Mode(region, accumulation)


def _counted(case, m):
    """``case``'s unit under mode ``m``, as a function of no arguments (a decode token after its prefill)."""
    found = case.unit(m)
    return found if callable(found) else (lambda: case.unit(m))


def casts(fn):
    """The casts between floating dtypes one call of ``fn`` dispatches (its second call: nothing lazy left)."""
    n = 0

    def seen(op, args, kwargs):
        nonlocal n
        if op.__name__.split(".")[0] not in ("_to_copy", "to") or not isinstance(args[0], torch.Tensor):
            return
        dtype = kwargs.get("dtype", args[1] if len(args) > 1 and isinstance(args[1], torch.dtype) else None)
        if args[0].is_floating_point() and dtype is not None and dtype.is_floating_point and dtype != args[0].dtype:
            n += 1

    fn()
    dispatched(fn, seen)
    return n


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


def run(reps, calls, progress=print, only=None):
    table = {c: v for c, v in cases().items() if only is None or only in c}
    samples = {c: {m: {"wall": [], "cpu": []} for m in MODES} for c in table}
    counted = {c: {"casts": {}, "hmp_frames": {}, "dtype": {}} for c in table}
    for name, case in table.items():  # warm-up, what each mode returns, casts and frames per unit
        for m in MODES:
            with mode(m, case.grad, case.whole) as given:
                for _ in range(3):
                    out = case.call(given)
                counted[name]["dtype"][m] = str(out.dtype).replace("torch.", "") if torch.is_tensor(out) else "-"
                counted[name]["casts"][m] = casts(_counted(case, given))
                if m in HMP_MODES:
                    counted[name]["hmp_frames"][m] = hmp_frames(_counted(case, given))
    for rep in range(reps):
        for name, case in table.items():
            for m in rotated(MODES, rep):
                gc.collect()
                with mode(m, case.grad, case.whole) as given:
                    case.call(given)
                    n = max(1, calls // case.per_sample)
                    wall, cpu = per_call_wall_and_thread(functools.partial(case.call, given), n)
                samples[name][m]["wall"].append(wall * 1e6)
                samples[name][m]["cpu"].append(cpu * 1e6)
        progress(f"rep {rep + 1}/{reps}")
    result = {}
    for name, per_mode in samples.items():
        result[name] = dict(counted[name], unit=table[name].unit_name)
        for clock in ("wall", "cpu"):
            base = per_mode["autocast"][clock]
            result[name][f"median_us_{clock}"] = {m: statistics.median(v[clock]) for m, v in per_mode.items()}
            result[name][f"over_autocast_{clock}"] = {
                m: statistics.median(s / a for s, a in zip(v[clock], base)) for m, v in per_mode.items()
            }
    return result


def report(result):
    e = "hmp engine=autocast"
    lines = [
        "| case | autocast us (wall / CPU) | hmp x autocast (wall / CPU) | engine=autocast x autocast (wall / CPU) "
        "| casts per unit: autocast / hmp / engine | hmp frames per unit: hmp / engine |",
        "|---|---:|---:|---:|---|---|",
    ]
    for case, r in result.items():
        us, xw, xc = r["median_us_wall"], r["over_autocast_wall"], r["over_autocast_cpu"]
        c, fr = r["casts"], r["hmp_frames"]
        lines.append(
            f"| {case} | {us['autocast']:.1f} / {r['median_us_cpu']['autocast']:.1f} | {xw['hmp']:.2f} / "
            f"{xc['hmp']:.2f} | {xw[e]:.2f} / {xc[e]:.2f} | {c['autocast']} / {c['hmp']} / {c[e]} per {r['unit']} "
            f"| {fr['hmp']} / {fr[e]} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--only", help="only the cases whose name contains this")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="hmp:")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    result = run(args.reps, args.calls, progress=lambda said: None, only=args.only)
    after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"torch {torch.__version__}, hmp from {HMP_DIR}, CPU, one thread, load average {load:.1f} before and "
        f"{after:.1f} after: median over {args.reps} reps of interleaved samples; (x autocast): the median over "
        f"reps of the sample over that rep's autocast one, by the wall clock and by this thread's CPU time"
    )
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


# its quickest run that still goes through its code (tests/integration/test_benchmark_scripts.py)
QUICK = ("--reps", "1", "--calls", "2")


if __name__ == "__main__":
    main()
