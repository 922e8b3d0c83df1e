"""What to expect on this machine, the model the demo trains on it, and how
many steps fit.

The model is fixed per kind of device (every CPU run trains the same model,
every GPU run the same larger one), so two runs anywhere compare like with
like; only the number of steps follows the measured time of a step. Before
training, the demo measures instead of assuming: whether the CPU has native
bf16 instructions, how a bf16 matmul of the model's size compares with fp32
here (worded by hmp/tools/speed.py, with every speed sentence), and how long
one training step takes in each configuration."""

import contextlib
import dataclasses
import platform
import statistics
import time

import torch

import hmp
from hmp.demo.training import build, random_batch, train_step

# the shortest run the demo sizes itself to: fewer steps and the val loss says little
MIN_STEPS = 40
# the CPU model: a step of 8 x 128 characters takes a few hundred ms on a 2-core CPU
CPU_MODEL = dict(n_layers=4, d_model=256, n_heads=4, batch_size=8, seq_len=128)
# the accelerator model. On a GPU every kernel launch costs microseconds whatever its size, and hmp
# adds host time to every wrapped call, so a small model is launch-bound and bf16 cannot pay there
# (the CPU model trained 1.47x slower under hmp on an H100). The rule: its largest matmul (tokens x
# d_model x 4*d_model) is at least ACCELERATOR_MIN_GEMM multiply-adds, about 0.2 ms in fp32 on a
# ~50 TFLOPS GPU, far above a launch plus hmp's host time per call (tens of microseconds).
ACCELERATOR_MODEL = dict(n_layers=6, d_model=768, n_heads=12, batch_size=16, seq_len=256)
ACCELERATOR_MIN_GEMM = 8e9


def model_for(device):
    """The model fields (Config's) the demo trains on ``device`` ("cpu",
    "cuda", "hpu"): a function of the device kind only, never of its speed."""
    return dict(CPU_MODEL if device == "cpu" else ACCELERATOR_MODEL)


def largest_gemm(fields):
    """Multiply-adds of the model's largest matmul: the MLP's first layer."""
    return fields["batch_size"] * fields["seq_len"] * fields["d_model"] * 4 * fields["d_model"]


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


def step_seconds(cfg, configurations, steps=3):
    """Mean seconds of one training step of ``cfg`` per configuration (hmp
    options or None), after one warm-up step (first calls allocate and fill
    caches) and outside convert(), which runs once per configuration. The
    mean, not the median: a busy machine's slow steps count in a run's time."""
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
        out.append(statistics.fmean(times[1:]))
    return out


@dataclasses.dataclass
class Plan:
    steps: int  # per configuration
    seconds: float  # both configurations' training, from the measured steps
    over_budget: bool  # MIN_STEPS alone take longer than the budget


def plan_steps(step_s, budget_s, max_steps):
    """As many steps as fit ``budget_s`` when a step of both configurations
    together takes ``step_s``, from MIN_STEPS to ``max_steps``."""
    fit = int(budget_s / step_s) if step_s > 0 else max_steps
    steps = max(MIN_STEPS, min(max_steps, fit))
    return Plan(steps, steps * step_s, fit < MIN_STEPS)
