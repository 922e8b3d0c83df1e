"""Wrapped calls per training step, and convert()'s time (issue 39).

Counts the calls that enter hmp's wrapper body (each pays hmp's per-call
cost) in one training step of the demo's model and of a small Llama
(transformers, random init), under convert() with the default lists; and
times convert() + revert(). A count, not a time: the same on any machine.
Before the pointwise rule, run it with HMP_PURE_PYTHON=1 (the C body's calls
are invisible to a profile function).

    python benchmarks/wrapped_calls.py [--json out.json]
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
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
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


# its quickest run that still goes through its code (tests/integration/test_benchmark_scripts.py)
QUICK = ()


if __name__ == "__main__":
    main()
