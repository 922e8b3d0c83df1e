"""Run hmp.tune on a small CNN (and, with --model lm, the demo's language
model) and compare the tuned lists with the default lists: step time
(interleaved medians) and final loss against fp32 after the same steps.

    python benchmarks/tune_models.py --model cnn --steps 60
"""

import argparse
import contextlib
import functools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
for p in (str(HERE), str(HERE.parent)):  # the sibling modules, and this checkout's hmp
    if p not in sys.path:
        sys.path.insert(0, p)

from workloads import grating_cnn  # noqa: E402

import hmp  # noqa: E402
from hmp.tools.timing import interleaved, per_call  # noqa: E402


def cnn_problem(seed=0, n=256, size=16, classes=4):
    """Gratings of four orientations in noise: a task a small CNN learns in a few dozen steps."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    ii, jj = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    angles = y.float() * (3.14159 / classes)
    phase = torch.rand(n, generator=g) * 6.28
    x = torch.sin(
        (ii[None] * torch.cos(angles)[:, None, None] + jj[None] * torch.sin(angles)[:, None, None]) * 1.2
        + phase[:, None, None]
    )
    x = (x + 2.5 * torch.randn(n, size, size, generator=g)).unsqueeze(1)
    model = grating_cnn(size, classes, seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        with hmp.disable_casts():
            opt.step()
        return loss

    return (model, opt), step, (x, y)


def lm_problem(seed=0):
    from hmp.demo import data as demo_data
    from hmp.demo.training import Config, build, train_step

    cfg = Config(seed=seed)
    corpus = demo_data.load()
    torch.manual_seed(seed)
    model, opt, sched = build(cfg)
    g = torch.Generator().manual_seed(seed)
    x, y = next(demo_data.batches(corpus.train, cfg.batch_size, cfg.seq_len, g))

    def step(x, y):
        return train_step(model, opt, sched, x, y, cfg)

    return (model, opt, sched), step, (x, y)


PROBLEMS = {"cnn": cnn_problem, "lm": lm_problem}


def final_loss(problem, lists, steps):
    """Train ``steps`` steps from the problem's fresh state with the given list files (None: fp32)."""
    hmp.revert()
    state, step, batch = problem()
    losses = []
    with hmp.converted(**lists) if lists is not None else contextlib.nullcontext():
        times = [per_call(lambda: losses.append(step(*batch))) for _ in range(steps)]
    return float(losses[-1].detach()), times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(PROBLEMS), default="cnn")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--out", default="/tmp/hmp-tuned", help="prefix for the written list files")
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="a CNN batch of 16: checks the script, measures nothing")
    args = ap.parse_args(argv)
    problem = PROBLEMS[args.model]
    if args.quick and args.model == "cnn":
        problem = functools.partial(cnn_problem, n=16)

    hmp.revert()
    state, step, batch = problem()
    result = hmp.tune(step, *batch, state=state, steps=min(args.steps, 30))
    print(result.table())
    bf16, fp32 = f"{args.out}-{args.model}-bf16.txt", f"{args.out}-{args.model}-fp32.txt"
    result.write(bf16, fp32)

    configs = {"fp32": None, "default lists": {}, "tuned lists": {"bf16_file_path": bf16, "fp32_file_path": fp32}}
    losses = {name: final_loss(problem, lists, args.steps)[0] for name, lists in configs.items()}
    # per round, each in the given order: 4 steps from a fresh state, the first (warm-up) not kept
    samplers = {name: functools.partial(final_loss, problem, lists, 4) for name, lists in configs.items()}
    rounds = interleaved(samplers, args.rounds, rotate=False)
    ms = {name: statistics.median(t for _, times in r for t in times[1:]) * 1e3 for name, r in rounds.items()}
    print(f"\n## {args.model}: {args.steps} steps from the same state; step time median of interleaved runs\n")
    print("| lists | final loss | vs fp32 | step ms | speed vs default lists |")
    print("|---|---:|---:|---:|---:|")
    for name in configs:
        rel = (losses[name] - losses["fp32"]) / losses["fp32"] * 100
        print(f"| {name} | {losses[name]:.4f} | {rel:+.2f}% | {ms[name]:.2f} | {ms['default lists'] / ms[name]:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"losses": losses, "step_ms": ms, "lists": result.lists}, f, indent=2)


# its quickest run that still goes through its code (tests/integration/test_benchmark_scripts.py)
QUICK = ("--quick", "--steps", "2", "--rounds", "1", "--out", "{tmp}/tuned")


if __name__ == "__main__":
    main()
