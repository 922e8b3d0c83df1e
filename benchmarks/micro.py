"""Per-call overhead on tiny tensors: F.linear, torch.mul, torch.cat.

Each sample times ``calls`` back-to-back calls of one op (timeit style) and
divides; samples of the modes are interleaved and medians reported. The
F.linear weight and bias are nn.Parameters, as in a model (torch.autocast
caches their casts inside one autocast region; the whole timed loop runs
inside one region, hmp is converted around it).
"""

import contextlib
import gc
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F
from configs import autocast_list_args

import hmp
from hmp.tools.timing import per_call

SIZE = 8
OPS = ("linear", "mul", "cat")


def modes(device):
    """name -> (label, context manager factory)."""

    def hmp_ctx(**kw):
        return lambda: hmp.converted(**kw)

    return {
        "plain": ("plain fp32", contextlib.nullcontext),
        "autocast": ("torch.autocast bf16", lambda: torch.autocast(device, dtype=torch.bfloat16)),
        "hmp-O1": ("hmp O1 (default lists)", hmp_ctx(opt_level="O1")),
        "hmp-O1-ac": ("hmp O1 (autocast's lists)", hmp_ctx(opt_level="O1", **autocast_list_args(device))),
    }


def _callables(device):
    torch.manual_seed(0)
    x = torch.randn(SIZE, SIZE, device=device)
    a = torch.randn(SIZE, SIZE, device=device)
    b = torch.randn(SIZE, SIZE, device=device)
    w = nn.Parameter(torch.randn(SIZE, SIZE, device=device))
    bias = nn.Parameter(torch.randn(SIZE, device=device))
    # attribute lookups happen at call time, so hmp's patched names are used
    return {
        "linear": lambda: F.linear(x, w, bias),
        "mul": lambda: torch.mul(a, b),
        "cat": lambda: torch.cat([a, b]),
    }


def run(device, reps, calls, sync, progress=print):
    fns = _callables(device)
    ms = modes(device)
    out = {op: {m: [] for m in ms} for op in OPS}
    dtypes = {op: {} for op in OPS}
    for op in OPS:  # warm-up, and the dtype each mode produces
        for m, (_, ctx) in ms.items():
            with ctx():
                for _ in range(200):
                    r = fns[op]()
                dtypes[op][m] = str(r.dtype).replace("torch.", "")
    for rep in range(reps):
        for op in OPS:
            for m, (_, ctx) in ms.items():
                gc.collect()
                with ctx():
                    out[op][m].append(per_call(fns[op], calls, sync) * 1e6)
        progress(f"  percall rep {rep + 1}/{reps}")
    result = {
        "calls_per_sample": calls,
        "reps": reps,
        "size": SIZE,
        "modes": {m: lbl for m, (lbl, _) in ms.items()},
        "ops": {},
    }
    for op in OPS:
        med = {m: statistics.median(v) for m, v in out[op].items()}
        result["ops"][op] = {"median_us": med, "samples_us": out[op], "out_dtype": dtypes[op]}
    return result


def overhead_ratio(result, mode, ops=OPS):
    """(mode - plain) / (autocast - plain), summed over ``ops``."""
    num = sum(result["ops"][op]["median_us"][mode] - result["ops"][op]["median_us"]["plain"] for op in ops)
    den = sum(result["ops"][op]["median_us"]["autocast"] - result["ops"][op]["median_us"]["plain"] for op in ops)
    return num / den if den > 0 else float("inf")
