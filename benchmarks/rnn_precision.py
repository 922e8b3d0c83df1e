"""bf16 vs fp32 RNN kernels on this CPU: error and speed (the measurement
behind where the shipped lists put lstm, gru, rnn_tanh and rnn_relu).

Error: one forward of the shape of pytorch/examples word_language_model
(seq 35, batch 20), relative to a float64 run of the same weights; speed:
forward + backward time, fp32 and bf16 samples interleaved, medians.
    python benchmarks/rnn_precision.py [--hidden 200] [--reps 7]
"""

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for p in (str(HERE), str(HERE.parent)):  # the sibling modules, and this checkout's hmp
    if p not in sys.path:
        sys.path.insert(0, p)

from workloads import RNN_KINDS as KINDS  # noqa: E402

from hmp.tools.timing import interleaved, per_call  # noqa: E402


def rel_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def step(module, x):
    out, _ = module(x)
    out.float().sum().backward()


def _sample(module, x, dtype):
    xd = x.to(dtype)  # outside the clock
    return per_call(lambda: step(module, xd))


def measure(kind, hidden, seq, batch, reps):
    torch.manual_seed(0)
    base = KINDS[kind](hidden)
    x = torch.randn(seq, batch, hidden)
    ref = base.double()(x.double())[0]
    errors = {}
    models = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = KINDS[kind](hidden)
        m.load_state_dict(base.state_dict())
        m = m.to(dtype)
        errors[dtype] = rel_error(m(x.to(dtype))[0], ref)
        models[dtype] = m
    samplers = {d: functools.partial(_sample, m, x, d) for d, m in models.items()}
    times = interleaved(samplers, reps, rotate=False, warmup=1)  # fp32, bf16 every round
    med = {d: statistics.median(v) for d, v in times.items()}
    return errors, med


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[200, 650])
    p.add_argument("--seq", type=int, default=35)
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, seq {a.seq}, batch {a.batch}, 2 layers")
    print("| kind | hidden | rel. error fp32 | rel. error bf16 | fwd+bwd fp32 ms | fwd+bwd bf16 ms | bf16 speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for hidden in a.hidden:
        for kind in KINDS:
            err, med = measure(kind, hidden, a.seq, a.batch, a.reps)
            f, b = med[torch.float32], med[torch.bfloat16]
            print(
                f"| {kind} | {hidden} | {err[torch.float32]:.1e} | {err[torch.bfloat16]:.1e} | {f * 1e3:.1f} | "
                f"{b * 1e3:.1f} | {f / b:.2f}x |",
                flush=True,
            )


# its quickest run that still goes through its code (tests/integration/test_benchmark_scripts.py)
QUICK = ("--hidden", "8", "--seq", "4", "--batch", "2", "--reps", "1")


if __name__ == "__main__":
    main()
