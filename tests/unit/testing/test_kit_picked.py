"""The testing kit on a torch function written in Python whose conversion takes effect inside its
body (issue 67 item 4): ``F.pad`` sees its caller's arguments before its body runs, and hmp casts
at the builtin its body calls (``torch._C._nn.pad``, a call that picks its kernel). What "the op
received" means is the arguments where the conversion takes effect: record_ops keeps, in a Python
torch function's Ran, the calls its body made, and assert_follows_rules compares the rules with
the first of them the same rule binds. Builtins are recorded as before, and the ops inside a torch
function of its own stay that function's."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hmp
from hmp.testing import assert_follows_rules, expected_call, follow, record_ops
from hmp.testing.recording import SEES_BODIES

BF16, FP32 = torch.bfloat16, torch.float32
SHAPES = {1: ((1, 2, 6), (1, 2)), 2: ((1, 2, 5, 6), (1, 2, 1, 1)), 3: ((1, 2, 4, 5, 6), (1, 1, 1, 1, 1, 1))}
needs_bodies = pytest.mark.skipif(not SEES_BODIES, reason="this torch has no torch.overrides.redispatch_function")


def _x(shape, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)


@needs_bodies
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular", "constant"])
def test_pad_follows_the_rules(mode, dims, dtype):
    """The repro's 24 calls: hmp runs each as its rule and torch.autocast do, and the kit agrees
    (reflect and replicate on bfloat16 failed: the kit compared F.pad's own uncast arguments)."""
    shape, pad = SHAPES[dims]
    x = _x(shape, dtype)
    with torch.autocast("cpu", BF16):
        autocast = F.pad(x, pad, mode=mode)
    hmp.convert()
    result = assert_follows_rules(F.pad, x, pad, mode=mode)
    assert result.dtype == autocast.dtype and torch.equal(result.double(), autocast.double())
    expected = expected_call(F.pad, x, pad, mode=mode)
    assert expected.left_to_torch or result.dtype == expected.dtype


@needs_bodies
def test_the_recording_holds_the_calls_a_python_functions_body_made():
    hmp.convert()
    x = _x(SHAPES[1][0], BF16)
    F.pad(x, (1, 2), mode="reflect")  # hmp's first call of a site decides its rule (probes on meta)
    with record_ops() as ran:
        F.pad(x, (1, 2), mode="reflect")
    assert [str(r) for r in ran] == ["pad(bfloat16) -> float32"]  # the outermost call, as before
    assert ran[0].received == (x,) and ran[0].fn is F.pad
    assert [str(r) for r in ran[0].inner if r.name == "pad"] == ["pad(float32) -> float32"]  # where hmp cast
    at = follow(F.pad, x, (1, 2), mode="reflect")
    assert at.expected.received == (FP32,) and at.dtype == FP32


@pytest.mark.parametrize(
    "call",
    [
        lambda a, b: F.linear(a, b),
        lambda a, b: torch.mm(a, b.t()),
        lambda a, b: a @ b.t(),
    ],
    ids=["F.linear", "torch.mm", "a @ b"],
)
def test_builtins_are_recorded_as_before(call):
    hmp.convert()
    a, b = torch.randn(2, 3), torch.randn(4, 3)
    with record_ops() as ran:
        call(a, b)
    computing = [r for r in ran if r.name in ("linear", "mm", "matmul")]
    assert len(computing) == 1 and computing[0].inputs == (BF16, BF16) and computing[0].dtype == BF16
    assert all(r.inner == () for r in ran)


@needs_bodies
def test_the_ops_inside_a_torch_function_of_its_own_stay_that_functions():
    """nn.MultiheadAttention: its products are multi_head_attention_forward's, not calls of the
    block (assert_runs_as sees the outermost); its Ran holds them as its body's calls."""
    hmp.convert()
    mha, q = nn.MultiheadAttention(6, 2), torch.randn(3, 1, 6)
    with record_ops() as ran:
        mha(q, q, q)
    names = [r.name for r in ran]
    assert "multi_head_attention_forward" in names and "linear" not in names
    forward = next(r for r in ran if r.name == "multi_head_attention_forward")
    assert [r.dtype for r in forward.inner if r.name == "linear"] == [BF16, BF16]


def test_a_python_function_hmp_casts_at_its_own_call_still_passes():
    hmp.convert()
    x = torch.randn(4, 8).bfloat16()
    assert assert_follows_rules(F.softmax, x, -1).dtype == FP32
    assert assert_follows_rules(F.linear, torch.randn(2, 8), torch.randn(3, 8)).dtype == BF16


@needs_bodies
@pytest.mark.parametrize(
    "made_float, said",
    [
        (True, r"the op received \(bfloat16\), the rules say \(float32\) \(fp32 rule of reflection_pad1d\)"),
        (False, r"it ran in bfloat16, the rules say float32"),
    ],
    ids=["result made float32", "result as it ran"],
)
def test_a_pad_whose_builtin_runs_uncast_fails(made_float, said):
    """A planted wrong conversion: the builtin F.pad's body calls runs with hmp's casts off (the
    input reaches it in bfloat16, where the FP32 rule says float32). With the result then made
    float32 the result's dtype is right, and only what the op received says the rule is broken."""
    hmp.convert()
    x = _x(SHAPES[1][0], BF16)
    assert_follows_rules(F.pad, x, (1, 2), mode="reflect")  # hmp's own: passes
    casting = torch._C._nn.pad

    def uncast(*args, **kwargs):
        with hmp.disable_casts():
            result = casting(*args, **kwargs)
        return result.float() if made_float else result

    torch._C._nn.pad = uncast
    try:
        with pytest.raises(AssertionError, match=said):
            assert_follows_rules(F.pad, x, (1, 2), mode="reflect")
    finally:
        torch._C._nn.pad = casting
    assert_follows_rules(F.pad, x, (1, 2), mode="reflect")
