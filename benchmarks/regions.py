"""What a no-grad region costs batch-1 inference: a region of one forward, and a region over a loop (issue 77).

    python benchmarks/regions.py [--rounds 15] [--reps 5] [--tokens 64] [--layers 4] [--width 512] [--json out.json]
    python benchmarks/regions.py --quick        # one small round: checks the script, measures little

Two shapes of ``torch.no_grad()`` on a ``nn.TransformerEncoder`` (``--layers`` layers ``--width`` wide,
batch 1, ``--tokens`` tokens, eval, one torch thread):

- **one forward per region**: ``with torch.no_grad(): model(x)`` per call, what an evaluation step or a
  served request does. A kept copy never serves a second call there: keeping every weight's copy to the
  region's exit cost fresh memory for each, given back at the exit and faulted in again at the next
  region, where a cast per call reuses one buffer.
- **a region over a loop**: ``with torch.no_grad():`` around ``--loop`` forwards (``generate()``): a
  weight's copy made once serves every forward after it.

Configurations: ``autocast`` (``torch.autocast("cpu", bfloat16)`` inside each region, its weight cache
on), ``hmp`` (``hmp.converted()``), ``hmp cache=False``. Each round takes one sample of every
configuration in a rotated order (hmp.tools.timing.interleaved); a sample is a fresh process (the
allocator's state, which decides whether freed copies go back to the system, is then a program's own,
not what the other configurations left) running ``--reps`` regions after a warm one. Times are that
thread's CPU time per forward (timing.per_call_wall_and_thread: one torch thread, so another process's load moves it
less than the wall clock), beside the wall clock; minor page faults per forward (getrusage), casts per
forward (dtype conversions dispatched) and the most bytes of copies held at once in a region
(hmp.cache_bytes() after each module: what the allocator must find fresh memory for), both deterministic.

Targets (stated, not asserted; issue 77): one forward per region, hmp <= 1.05x ``cache=False``'s time and
<= 1.10x autocast's; over a loop, hmp casts each weight once per region, as autocast does.
"""

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import hmp  # noqa: E402
from hmp.tools.timing import interleaved, per_call_wall_and_thread  # noqa: E402

QUICK = ("--quick",)
CONFIGS = ("autocast", "hmp", "hmp cache=False")
SHAPES = ("one forward per region", "a region over a loop")
TARGETS = (
    ("one forward per region", "hmp", "hmp cache=False", 1.05),
    ("one forward per region", "hmp", "autocast", 1.10),
)


def model(layers, width, tokens):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0)
    # sequence-first and enable_nested_tensor off: the layer's fused eval path (one C++ op no
    # scheme casts) stays off, so each scheme runs its own casts and matrix products
    encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()
    return encoder, torch.randn(tokens, 1, width)


@contextlib.contextmanager
def scheme(config):
    if config == "autocast":
        yield
    else:
        with hmp.converted(cache=config == "hmp"):
            yield


def region(config):
    """The block each region opens: torch.no_grad(), with autocast's own region inside it for autocast."""
    if config == "autocast":
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        return stack
    return torch.no_grad()


def forwards(config, shape, encoder, x, loop):
    """One region of ``shape``; returns the forwards it ran."""
    n = 1 if shape == SHAPES[0] else loop
    with region(config):
        for _ in range(n):
            encoder(x)
    return n


class Casts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.hmp.to_finite):
            self.n += 1
        return func(*args, **(kwargs or {}))


def casts_per_forward(config, shape, encoder, x, loop):
    with scheme(config):
        forwards(config, shape, encoder, x, loop)  # the scheme's state after a warm region, as when timed
        with Casts() as counted:
            n = forwards(config, shape, encoder, x, loop)
    return counted.n / n


def held_bytes(config, shape, encoder, x, loop):
    """The most bytes of weight copies hmp holds at once during a region (after a warm one); 0 for autocast,
    whose cache no public call reports."""
    if config == "autocast":
        return 0
    most = [0]
    handles = [
        m.register_forward_hook(lambda *_: most.__setitem__(0, max(most[0], hmp.cache_bytes())))
        for m in encoder.modules()
    ]
    try:
        with scheme(config):
            forwards(config, shape, encoder, x, loop)
            most[0] = 0
            forwards(config, shape, encoder, x, loop)
    finally:
        for h in handles:
            h.remove()
    return most[0]


def one_sample(config, shape, args):
    """A sample in this process (``--sample``): what the parent reads from its standard output."""
    torch.set_num_threads(1)
    encoder, x = model(args.layers, args.width, args.tokens)
    with scheme(config):
        forwards(config, shape, encoder, x, args.loop)  # warm: the region's first state is the timed ones'
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        counts = []  # forwards per rep
        wall, cpu = per_call_wall_and_thread(
            lambda: counts.append(forwards(config, shape, encoder, x, args.loop)), calls=args.reps
        )
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    n = sum(counts) / args.reps  # forwards per timed call
    return {"cpu_ms": cpu / n * 1e3, "wall_ms": wall / n * 1e3, "faults": faults * args.reps / sum(counts)}


def sampler(config, shape, args):
    argv = [sys.executable, __file__, "--sample", config, shape, "--reps", str(args.reps)]
    argv += ["--tokens", str(args.tokens), "--layers", str(args.layers), "--width", str(args.width)]
    argv += ["--loop", str(args.loop)]

    def sample():
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    return sample


def measure(args):
    encoder, x = model(args.layers, args.width, args.tokens)
    weights = sum(1 for p in encoder.parameters() if p.dim() == 2)
    results = {}
    for shape in SHAPES:
        samplers = {c: sampler(c, shape, args) for c in CONFIGS}

        def after(i, _, shape=shape):
            print(f"{shape}: round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)

        samples = interleaved(samplers, args.rounds, after_round=after)
        row = {}
        for c in CONFIGS:
            got = samples[c]
            row[c] = {k: statistics.median(s[k] for s in got) for k in ("cpu_ms", "wall_ms", "faults")}
            row[c]["casts"] = casts_per_forward(c, shape, encoder, x, args.loop)
            row[c]["held_mib"] = held_bytes(c, shape, encoder, x, args.loop) / 2**20
        results[shape] = row
    return results, weights


def report(results, weights, args):
    lines = [
        f"regions: torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, one torch thread; "
        f"{args.layers}-layer encoder {args.width} wide, {args.tokens} tokens, batch 1 ({weights} weight matrices); "
        f"{args.rounds} rounds of {args.reps} regions; loop regions {args.loop} forwards",
        "",
        "| shape | configuration | CPU ms / forward | wall ms / forward | minor faults / forward | casts / forward "
        "| copies held at once (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for shape, row in results.items():
        for c, r in row.items():
            lines.append(
                f"| {shape} | {c} | {r['cpu_ms']:.2f} | {r['wall_ms']:.2f} | {r['faults']:.0f} | {r['casts']:.1f} "
                f"| {r['held_mib']:.1f} |"
            )
    lines += ["", "Targets (stated, not asserted): ratios of CPU time per forward"]
    for shape, a, b, bound in TARGETS:
        ratio = results[shape][a]["cpu_ms"] / results[shape][b]["cpu_ms"]
        wall = results[shape][a]["wall_ms"] / results[shape][b]["wall_ms"]
        met = "met" if ratio <= bound else "NOT met"
        lines.append(f"- {shape}: {a} / {b} <= {bound:.2f}: {ratio:.2f} ({met}); wall clock {wall:.2f}")
    loop = results[SHAPES[1]]
    lines.append(
        f"- a region over a loop: casts per forward, hmp {loop['hmp']['casts']:.1f} vs autocast "
        f"{loop['autocast']['casts']:.1f} ({weights} weight matrices cast once per region: "
        f"{weights / args.loop:.1f} per forward)"
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines.append(f"Load average at the end: {load:.1f} (CPU time is the process's own; the wall clock moves with load)")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--loop", type=int, default=8)
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--quick",
        action="store_true",
        help="1 round of 2 regions of a 2-layer 64-wide encoder (6 processes: checks the script)",
    )
    p.add_argument("--sample", nargs=2, metavar=("CONFIG", "SHAPE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sample:
        print(json.dumps(one_sample(*args.sample, args)))
        return
    if args.quick:
        args.rounds, args.reps, args.tokens, args.layers, args.width, args.loop = 1, 2, 8, 2, 64, 3
    torch.set_num_threads(1)
    results, weights = measure(args)
    print(report(results, weights, args))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
