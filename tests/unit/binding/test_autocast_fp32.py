"""The default FP32 list against torch.autocast's float32 ops (docs/never-changes.md, "torch.autocast's
float32 ops"): it holds every op CPU autocast computes in float32, checked against autocast itself
on the running torch; CUDA autocast's further float32 ops are each named in the doc with a reason."""

import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hmp
from hmp.binding.list_files import default_path, names
from hmp.testing import strategies as hst
from hmp.testing.entries import public_function

DOC = Path(__file__).resolve().parents[3] / "docs" / "never-changes.md"


def _names(file):
    return names(default_path(file))


def _fp32():
    return set(_names("fp32.txt"))


def test_the_default_fp32_list_holds_every_op_cpu_autocast_computes_in_float32():
    missing = sorted(set(_names("autocast_cpu_fp32.txt")) - _fp32())
    assert not missing, missing


def _section():
    text = DOC.read_text()
    start = text.index("## torch.autocast's float32 ops")
    return text[start : text.index("\n## ", start + 1)]


def test_every_cuda_autocast_float32_op_hmp_leaves_to_torch_is_named_with_its_reason():
    bullets = "\n".join(line for line in _section().splitlines() if not line.startswith("**Rule.**"))
    named = set(re.findall(r"`([A-Za-z_0-9*]+)`", bullets.split("\n- ", 1)[1]))
    left = sorted(set(_names("autocast_cuda_fp32.txt")) - _fp32())
    unnamed = [n for n in left if n not in named and not any(p.endswith("*") and n.startswith(p[:-1]) for p in named)]
    assert not unnamed, f"CUDA autocast computes these in float32, hmp leaves them to torch, undocumented: {unnamed}"
    # and the doc names no op that the FP32 list holds after all (a stale reason)
    stale = sorted(n for n in named & _fp32() if n in set(_names("autocast_cuda_fp32.txt")))
    assert not stale, stale


def _runnable():
    """(name, function) of autocast's CPU float32 ops this torch has, with sample calls."""
    out = []
    for name in _names("autocast_cpu_fp32.txt"):
        fn = public_function(name)
        if fn is None:
            continue
        try:
            hst.calls(name)
        except LookupError:
            continue
        out.append((name, fn))
    return out


RUNNABLE = _runnable()


def test_most_of_autocasts_float32_ops_are_run_here():
    assert len(RUNNABLE) >= 0.7 * len(_names("autocast_cpu_fp32.txt")), [n for n, _ in RUNNABLE]


def _floats(out):
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t.dtype for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()]


@pytest.mark.parametrize("name", [n for n, _ in RUNNABLE])
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_autocast_and_hmp_both_compute_it_in_float32_from_bf16_inputs(name, data):
    args, kwargs = data.draw(hst.calls(name, dtypes=(torch.bfloat16,), mixed=False))
    with torch.autocast("cpu", torch.bfloat16):
        try:
            auto = public_function(name)(*args, **kwargs)
        except (RuntimeError, ValueError, TypeError):  # a bf16 call torch itself refuses: not this test's
            return
    with hmp.converted():
        mine = public_function(name)(*args, **kwargs)
    want = _floats(auto)
    # autocast's own answer says float32 (the shipped file is autocast's list), and hmp's matches it
    assert torch.float32 in want or not want, (name, want)
    assert _floats(mine) == want, (name, _floats(mine), want)
