"""Host time hmp adds to a call and to a decode token, measured without a GPU (issue 66, item 6).

    python benchmarks/hostcost.py [--devices fastmeta,cpu] [--rounds 21] [--calls 300] [--tokens 16] [--json out.json]
    python benchmarks/hostcost.py --quick        # a few rounds of a few calls: checks the script, measures little

On a GPU at batch 1 the device waits for the host: what a mixed-precision scheme costs there is the
Python and dispatch it adds to each call, not kernel time. This script measures that host time on a
CPU-only machine, on two devices:

- ``fastmeta`` (the default): meta tensors with torch's C++ meta kernels put back
  (benchmarks/fastmeta.py; stock meta runs Python references for ~1070 ops, a meta ``add`` ~100 us
  against ~1 us). Every kernel is free; what is timed is the host's work. One calibration seen
  (shared/hostcost): an H200 host's us ~ 8 x fastmeta us. Read ratios, not absolute times.
- ``cpu``: real CPU tensors of 8x64 (kernels of a few us), CPU autocast's real policy.

Cases: ``F.linear(a, w)`` in a training forward (``a`` a non-leaf activation that requires grad, ``w``
a trainable leaf, one output kept alive as a graph would) and under ``torch.no_grad()``;
``torch.mm`` and ``torch.matmul`` of two activations and ``torch.softmax`` of float32 (FP32 list:
nothing to cast), under ``torch.no_grad()``; and one decode token of a tiny Llama
(workloads.llama("proxy"): hidden 64, 4 layers, batch 1, a KV cache after an 8-token prefill, the
whole decode in one ``torch.no_grad()`` block as ``generate()`` runs it).

Configurations: ``torch`` (plain float32: the baseline), ``autocast`` (on cpu ``torch.autocast("cpu",
bfloat16)``; on fastmeta, which has no autocast key, an emulation of the casts CUDA autocast makes for
the per-call cases, from Python: the activation cast per call, the weight cast once per region; not
emulated for the decode token, reported n/a there), ``floor`` (benchmarks/floor.py's
``installed()``: the smallest Python wrapper with hmp's casts at hmp's sites), ``hmp``
(``hmp.converted()``) and ``hmp frozen`` (``hmp.converted()`` and ``hmp.frozen_weights()``: no-grad
cases and decode only). hmp, the floor and autocast each enter once per sample; a sample times every
case in that configuration (``calls`` calls each, the decode ``tokens`` tokens), and samples
interleave round by round, the order rotated (hmp.tools.timing.interleaved). What a configuration
adds is the median over rounds of its sample minus that round's plain-torch sample; the ratios are
of those medians.

Targets (stated, not asserted; the issue's):

- hmp's added time <= 1.2x the floor's, per ``F.linear`` call in grad mode and under no_grad, and per
  decode token;
- hmp inside ``frozen_weights()`` adds no more than hmp without it (per no-grad call and per token).
"""

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
for p in (str(HERE), str(HERE.parent)):  # the sibling modules, and this checkout's hmp
    if p not in sys.path:
        sys.path.insert(0, p)

import fastmeta  # noqa: E402
import floor  # noqa: E402
import workloads  # noqa: E402

import hmp  # noqa: E402
from hmp.tools.timing import collector_paused, interleaved, per_call, quartiles  # noqa: E402

CONFIGS = ("torch", "autocast", "floor", "hmp", "hmp frozen")
DEVICES = ("fastmeta", "cpu")
DECODE = "decode token"
# case -> grad mode on
CASES = {
    "linear (grad)": True,
    "linear (no_grad)": False,
    "mm (no_grad)": False,
    "matmul (no_grad)": False,
    "softmax (no_grad, FP32 list)": False,
}
# (case, numerator, denominator, at most): ratios of added host time (stated, not asserted)
TARGETS = (
    ("linear (grad)", "hmp", "floor", 1.2),
    ("linear (no_grad)", "hmp", "floor", 1.2),
    (DECODE, "hmp", "floor", 1.2),
    ("linear (no_grad)", "hmp frozen", "hmp", 1.0),
    (DECODE, "hmp frozen", "hmp", 1.0),
)
H200_PER_FASTMETA = 8  # one calibration seen: an H200 host's us per fastmeta us
PROMPT = 8
BF16 = torch.bfloat16


def applies(config, case):
    """frozen_weights() is for no-grad blocks: not timed in a training forward."""
    return not (config == "hmp frozen" and CASES.get(case, False))


def _tensor_device(device):
    return "meta" if device == "fastmeta" else device


def tensors(device):
    """The per-call cases' tensors: x, y activations (8x64, 64x64), w a trainable weight (64x64), a an
    activation inside a training forward (an op's output that requires grad, not a leaf)."""
    d = _tensor_device(device)
    torch.manual_seed(0)
    make = functools.partial(torch.randn, device=d)
    x, y = make(8, 64), make(64, 64)
    w = nn.Parameter(make(64, 64))
    with torch.enable_grad():
        a = make(8, 64, requires_grad=True) * 1.0
    return {"x": x, "y": y, "w": w, "a": a}


def calls(t):
    """case -> the call, made through the site (``F.linear``, ``torch.mm`` ...) as a model's is."""
    x, y, w, a = t["x"], t["y"], t["w"], t["a"]
    return {
        "linear (grad)": lambda: F.linear(a, w),
        "linear (no_grad)": lambda: F.linear(x, w),
        "mm (no_grad)": lambda: torch.mm(x, y),
        "matmul (no_grad)": lambda: torch.matmul(x, y),
        "softmax (no_grad, FP32 list)": lambda: torch.softmax(x, -1),
    }


def emulated_autocast(t):
    """On meta (no autocast key) the casts CUDA autocast makes, from Python: case -> (call, the
    region's weight cache, emptied per region). Autocast caches the cast of a leaf that requires
    grad for its region; the activation is cast every call; softmax of float32 is not cast."""
    x, y, w, a = t["x"], t["y"], t["w"], t["a"]
    cache = {}
    bf16 = torch.Tensor.bfloat16

    def weight():
        c = cache.get("w")
        if c is None:
            c = cache["w"] = bf16(w)
        return c

    return {
        "linear (grad)": lambda: F.linear(bf16(a), weight()),
        "linear (no_grad)": lambda: F.linear(bf16(x), weight()),
        "mm (no_grad)": lambda: torch.mm(bf16(x), bf16(y)),
        "matmul (no_grad)": lambda: torch.matmul(bf16(x), bf16(y)),
        "softmax (no_grad, FP32 list)": lambda: torch.softmax(x, -1),
    }, cache


@contextlib.contextmanager
def scheme(config):
    """The configuration's wrappers for one sample: hmp converted, or the floor's installed."""
    if hmp.is_converted():
        raise RuntimeError(f"{config}: hmp converted on entry (a sample before did not revert)")
    with contextlib.ExitStack() as stack:
        if config.startswith("hmp"):
            stack.enter_context(hmp.converted(opt_level="O1"))
        elif config == "floor":
            stack.enter_context(floor.installed(opt_level="O1"))
        yield
    if hmp.is_converted():
        raise RuntimeError(f"{config}: hmp still converted after its sample")


@contextlib.contextmanager
def region(config, device, grad):
    """One case's block: frozen_weights() (hmp frozen), the grad mode, CPU autocast's region."""
    with contextlib.ExitStack() as stack:
        if config == "hmp frozen":
            stack.enter_context(hmp.frozen_weights())
        stack.enter_context(torch.enable_grad() if grad else torch.no_grad())
        if config == "autocast" and device == "cpu":
            stack.enter_context(torch.autocast("cpu", dtype=BF16))
        yield


def time_call(fn, n):
    """us per call of ``n`` calls; one call first (a weight's cast made, its output kept alive)."""
    keep = fn()
    with collector_paused():
        seconds = per_call(fn, n)
    del keep
    return seconds * 1e6


# ---------------------------------------------------------------- decode


class Decoder:
    """A tiny Llama on the device, and one token's host time (after a prefill, with the KV cache)."""

    def __init__(self, device):
        self.model, _ = workloads.llama("proxy", _tensor_device(device))
        self.model.eval()
        self.kw = workloads.cache_kw(self.model)
        d = _tensor_device(device)
        self.prompt = torch.zeros(1, PROMPT, dtype=torch.long, device=d)
        self.token = torch.zeros(1, 1, dtype=torch.long, device=d)  # token 0 fed back: what a token costs

    def per_token(self, tokens):
        """(us per token over ``tokens`` tokens, the logits' dtype); the caller holds the region."""
        out = self.model(input_ids=self.prompt, use_cache=True)
        state = [workloads.cache_of(out), None]

        def step():
            out = self.model(input_ids=self.token, use_cache=True, **{self.kw: state[0]})
            state[0], state[1] = workloads.cache_of(out), out.logits.dtype

        step()  # the first token: weights cast where a scheme keeps them
        with collector_paused():
            seconds = per_call(step, tokens)
        return seconds * 1e6, state[1]


def calls_per_token(device, decoder, tokens=4):
    """config -> (Python frames, C calls, bytecode instructions) one decode token runs over plain torch's
    (``sys.setprofile``'s events, then ``sys.settrace``'s opcode events; every file): deterministic, so
    they say what a timing on a busy host cannot. Of the three, the time hmp adds over the floor's has
    followed the bytecode ratio (2.0x at 1.6-1.8x the time), not the frame ratio (1.25x)."""
    counts = {}
    for config in CONFIGS:
        if config == "autocast":
            continue  # on fastmeta an emulation, on the CPU C++: no frames to count against
        seen = {"call": 0, "c_call": 0, "opcode": 0}

        def profile(frame, event, arg, seen=seen):
            if event in seen:
                seen[event] += 1

        def opcodes(frame, event, arg, seen=seen):
            if event == "opcode":
                seen["opcode"] += 1
            return opcodes

        def trace(frame, event, arg):
            frame.f_trace_opcodes, frame.f_trace_lines = True, False
            return opcodes

        with scheme(config), region(config, device, False):
            decoder.per_token(1)  # the first token casts what a scheme keeps
            out = decoder.model(input_ids=decoder.prompt, use_cache=True)
            state = workloads.cache_of(out)
            for hook, counter in ((sys.setprofile, profile), (sys.settrace, trace)):
                hook(counter)
                try:
                    for _ in range(tokens):
                        out = decoder.model(input_ids=decoder.token, use_cache=True, **{decoder.kw: state})
                        state = workloads.cache_of(out)
                finally:
                    hook(None)
        counts[config] = tuple(seen[e] / tokens for e in ("call", "c_call", "opcode"))
    base = counts.pop("torch")
    return {c: tuple(n - b for n, b in zip(ns, base)) for c, ns in counts.items()}


# ---------------------------------------------------------------- samples


def sampler(config, device, t, decoder, n, tokens, dtypes):
    """One sample of ``config``: case -> us (per call; per token for the decode)."""
    emulate = config == "autocast" and device == "fastmeta"
    fns, cache = emulated_autocast(t) if emulate else (calls(t), None)

    def sample():
        gc.collect()
        out = {}
        with scheme(config):
            for case, grad in CASES.items():
                if not applies(config, case):
                    continue
                if cache is not None:
                    cache.clear()  # one region per case sample
                with region(config, device, grad):
                    out[case] = time_call(fns[case], n)
                    dtypes.setdefault(case, {}).setdefault(config, str(fns[case]().dtype).replace("torch.", ""))
            if decoder is not None and not emulate:
                gc.collect()
                with region(config, device, False):
                    out[DECODE], dtype = decoder.per_token(tokens)
                dtypes.setdefault(DECODE, {}).setdefault(config, str(dtype).replace("torch.", ""))
        return out

    return sample


def _median(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else None


def _ratio(num, den):
    return num / den if num is not None and den is not None and den > 0 else None


def measure(device, rounds, n, tokens, decode=True, progress=None):
    """device -> its results: per case, median us per configuration, added us over plain torch, ratios."""
    if device == "fastmeta":
        fastmeta.install()
    t = tensors(device)
    decoder = Decoder(device) if decode else None
    dtypes = {}
    samplers = {c: sampler(c, device, t, decoder, n, tokens, dtypes) for c in CONFIGS}

    def after(i, _):
        if progress:
            progress(f"{device}: round {i + 1}/{rounds}")

    raw = interleaved(samplers, rounds, warmup=1, after_round=after)
    cases = list(CASES) + ([DECODE] if decode else [])
    result = {}
    for case in cases:
        base = [s.get(case) for s in raw["torch"]]
        row = {"us": {}, "added_us": {}, "added_quartiles_us": {}, "dtype": dtypes.get(case, {})}
        for config in CONFIGS:
            mine = [s.get(case) for s in raw[config]]
            row["us"][config] = _median(mine)
            if config == "torch":
                continue
            added = [m - b for m, b in zip(mine, base) if m is not None and b is not None]
            row["added_us"][config] = _median(added)
            row["added_quartiles_us"][config] = list(quartiles(added)) if added else None
        add = row["added_us"]
        row["hmp_over_floor"] = _ratio(add.get("hmp"), add.get("floor"))
        row["frozen_over_hmp"] = _ratio(add.get("hmp frozen"), add.get("hmp"))
        row["hmp_over_autocast"] = _ratio(add.get("hmp"), add.get("autocast"))
        result[case] = row
    return result


def targets(results):
    out = []
    for device, rows in results.items():
        for case, num, den, limit in TARGETS:
            row = rows.get(case)
            if row is None:
                continue
            r = _ratio(row["added_us"].get(num), row["added_us"].get(den))
            out.append(
                {
                    "device": device,
                    "case": case,
                    "ratio": f"{num} / {den}",
                    "at_most": limit,
                    "measured": r,
                    "met": None if r is None else r <= limit,
                }
            )
    return out


# ---------------------------------------------------------------- report


def _f(v, fmt="{:.1f}"):
    return "n/a" if v is None else fmt.format(v)


def table(device, rows):
    unit = "us per call (per token for the decode)"
    lines = [f"### {device}: host us added over plain torch, {unit}; median over rounds", ""]
    added = [c for c in CONFIGS if c != "torch"]
    lines.append("| case | torch (us) | " + " | ".join(f"+{c}" for c in added) + " | hmp/floor | frozen/hmp |")
    lines.append("|---|" + "---:|" * (len(added) + 3))
    for case, row in rows.items():
        cells = [_f(row["us"]["torch"])] + [_f(row["added_us"].get(c)) for c in added]
        cells += [_f(row["hmp_over_floor"], "{:.2f}x"), _f(row["frozen_over_hmp"], "{:.2f}x")]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fastmeta_add_us():
    """us of one meta ``add`` on fastmeta (median of 5 samples of 2000): the device's unit."""
    m = torch.empty(8, 64, device="meta")
    return statistics.median(per_call(lambda: m + m, 2000) * 1e6 for _ in range(5))


def _commit():
    try:
        p = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
        return p.stdout.strip() or None
    except OSError:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="fastmeta", help="comma-separated: fastmeta, cpu")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--calls", type=int, default=300, help="calls per case per sample")
    ap.add_argument("--tokens", type=int, default=16, help="decode tokens per sample")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 20 calls and 2 tokens: checks the script")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.calls, a.tokens = 2, 20, 2
    devices = [d for d in a.devices.split(",") if d]
    unknown = set(devices) - set(DEVICES)
    if unknown:
        ap.error(f"unknown devices {sorted(unknown)}: choose from {', '.join(DEVICES)}")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # host time is one thread's
    meta = {
        "torch": torch.__version__,
        "hmp": getattr(hmp, "__version__", None) or str(getattr(hmp, "version", "")) or None,
        "hmp_path": str(Path(hmp.__file__).resolve().parent),
        "commit": _commit(),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_at_start": list(os.getloadavg()),
        "rounds": a.rounds,
        "calls": a.calls,
        "tokens": a.tokens,
        "quick": a.quick,
        "devices": devices,
    }
    print(f"hostcost: torch {meta['torch']}, hmp at commit {meta['commit']}, {meta['machine']}; {a.rounds} rounds")
    results, calls = {}, {}  # calls: device -> config -> (Python frames, C calls, opcodes) per decode token over torch
    for device in devices:
        if device == "fastmeta":
            meta["fastmeta"] = fastmeta.install()
            meta["fastmeta_add_us"] = fastmeta_add_us()
        results[device] = measure(
            device,
            a.rounds,
            a.calls,
            a.tokens,
            decode=not a.no_decode,
            progress=lambda s: print(s, file=sys.stderr, flush=True),
        )
        print()
        print(table(device, results[device]), flush=True)
        if not a.no_decode:
            per_token = calls[device] = calls_per_token(device, Decoder(device))
            said = ", ".join(f"{c} {f:.0f} / {k:.0f} / {o:.0f}" for c, (f, k, o) in per_token.items())
            print(
                f"\n{device}: Python frames / C calls / opcodes per decode token over plain torch: {said}",
                flush=True,
            )
    meta["load_at_end"] = list(os.getloadavg())
    met = targets(results)
    print("\nTargets (stated, not asserted): ratios of added host time")
    for tg in met:
        verdict = "n/a" if tg["met"] is None else "met" if tg["met"] else "NOT met"
        measured = _f(tg["measured"], "{:.2f}")
        print(f"- target {tg['device']} {tg['case']}: {tg['ratio']} <= {tg['at_most']}: {measured} ({verdict})")
    if "fastmeta_add_us" in meta:
        print(
            f"\nfastmeta: a meta add {meta['fastmeta_add_us']:.2f} us; one calibration seen: an H200 host's us "
            f"~ {H200_PER_FASTMETA} x fastmeta us. Load average at start {meta['load_at_start'][0]:.1f}, "
            f"at end {meta['load_at_end'][0]:.1f}."
        )
    if a.json:
        out = {"meta": meta, "results": results, "targets": met, "calls_per_token_over_torch": calls}
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


QUICK = ("--quick", "--devices", "fastmeta,cpu")

if __name__ == "__main__":
    sys.exit(main())
