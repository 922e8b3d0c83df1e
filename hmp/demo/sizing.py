"""What to expect on this machine, and a run sized to it.

Before training, the demo measures instead of assuming: whether the CPU
has native bf16 instructions, how a bf16 matmul of the model's size compares
with fp32 here, and how long one training step takes in each configuration.
From the step times it picks a run that finishes both configurations in
about ``budget_s`` seconds on this machine, idle or busy."""

import contextlib
import dataclasses
import platform
import statistics
import time

import torch

import hmp
from hmp.demo.training import build, random_batch, train_step

# the shortest run the demo trains: fewer steps and the val loss says little
MIN_STEPS = 40
# the models the demo can train, largest (the default) first, as Config fields: it trains the
# first that fits MIN_STEPS into the budget, the last when none does
LADDER = (
    dict(batch_size=8, n_layers=4, d_model=256, seq_len=128),
    dict(batch_size=4, n_layers=4, d_model=256, seq_len=128),
    dict(batch_size=4, n_layers=2, d_model=256, seq_len=128),
    dict(batch_size=2, n_layers=2, d_model=256, seq_len=128),
    dict(batch_size=2, n_layers=2, d_model=128, seq_len=64),
)


def flops(fields):
    """A step's matmul work, up to a constant: tokens x layers x d_model^2."""
    return fields["batch_size"] * fields["seq_len"] * fields["n_layers"] * fields["d_model"] ** 2


def native_bf16(device="cpu", cpuinfo=None, machine=None):
    """``(True/False/None, why)``: whether ``device`` has bf16 arithmetic in
    hardware, read from what the system reports (None: it does not say).
    ``cpuinfo``/``machine``: /proc/cpuinfo's text and platform.machine(),
    read from this machine when not given."""
    if device == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, f"{torch.cuda.get_device_name()} {'supports' if ok else 'does not support'} bf16"
    if device != "cpu":
        return True, f"{device} computes in bf16 natively"
    machine = (machine or platform.machine()).lower()
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return None, f"this {machine} CPU does not report its instruction sets here"
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    if machine in ("x86_64", "amd64", "i686"):
        have = sorted(flags & {"avx512_bf16", "amx_bf16"})
        if have:
            return True, f"this x86 CPU has {' and '.join(have)}"
        return False, "this x86 CPU has neither avx512_bf16 nor amx_bf16: bf16 arithmetic is emulated"
    if machine in ("aarch64", "arm64"):
        if "bf16" in flags:
            return True, "this ARM CPU has the bf16 extension"
        return False, "this ARM CPU lacks the bf16 extension: bf16 arithmetic is emulated"
    return None, f"hmp cannot tell whether this {machine} CPU has bf16 instructions"


def expectation(matmul_ratio, native):
    """One line: what the hmp run's speed will be against fp32, and why."""
    has, why = native
    if matmul_ratio < 0.9:
        return f"expect hmp to train faster than fp32 here: a bf16 matmul takes {matmul_ratio:.2f}x fp32's time ({why})"
    if matmul_ratio <= 1.1:
        return (
            f"expect about fp32's speed here: a bf16 matmul takes {matmul_ratio:.2f}x fp32's time ({why}); "
            "hmp's numbers (losses, casts) are what this run shows"
        )
    return (
        f"expect hmp to train SLOWER than fp32 here: a bf16 matmul takes {matmul_ratio:.2f}x fp32's time "
        f"({why}); no bf16 scheme gains on this machine. The losses and casts are still hmp's; the speed-up "
        "comes on CPUs with native bf16 (AVX512-BF16, AMX, ARM bf16) and on GPUs"
    )


def step_seconds(cfg, configurations, steps=3):
    """Median seconds of one training step of ``cfg`` per configuration
    (hmp options or None), after one warm-up step (first calls allocate and
    fill caches) and outside convert(), which runs once per configuration."""
    x, y = random_batch(cfg)
    out = []
    for options in configurations:
        model, opt, sched = build(cfg)
        times = []
        with hmp.converted(**options) if options is not None else contextlib.nullcontext():
            for _i in range(steps + 1):
                start = time.perf_counter()
                train_step(model, opt, sched, x, y, cfg).item()
                times.append(time.perf_counter() - start)
        out.append(statistics.median(times[1:]))
    return out


@dataclasses.dataclass
class Plan:
    cfg: object  # the Config to train
    seconds: float  # both configurations' training, estimated from a measured step
    shrunk: bool  # a smaller model than the first of the ladder
    measured: int  # ladder entries timed to decide


def fit(cfg, measure, budget_s, max_steps, ladder=LADDER):
    """The largest ``ladder`` entry (the first is the largest) of which
    MIN_STEPS fit ``budget_s``, with as many steps as fit (at most
    ``max_steps``); the smallest when none fits.

    ``measure(cfg)`` times one step of ``cfg`` for all configurations
    together. Entries are timed from the smallest up, so a slow machine
    pays only for small models; the walk stops at the first entry that
    does not fit, or before one that cannot, judging by the square root of
    its work ratio (real step times grow slower than work: fixed costs)."""
    chosen = per = None
    measured = 0
    for fields in reversed(ladder):
        if per is not None and per * (flops(fields) / flops(chosen)) ** 0.5 * MIN_STEPS > budget_s:
            break
        seconds = measure(dataclasses.replace(cfg, **fields))
        measured += 1
        if chosen is not None and seconds * MIN_STEPS > budget_s:
            break
        chosen, per = fields, seconds
    steps = max(MIN_STEPS, min(max_steps, int(budget_s / per)))
    return Plan(dataclasses.replace(cfg, steps=steps, **chosen), steps * per, chosen != ladder[0], measured)
