"""Ops whose call picks its kernel (hmp/binding/picked.py): ``F.pad``'s mode picks reflection_pad2d (FP32
list) or constant_pad_nd (no list). Each call follows the rule of the kernel it reaches, as torch.autocast
(the oracle: it casts at the dispatcher) does, eager, compiled and exported alike; a kind of call is
traced once."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import hmp
from hmp.binding import aten, lists, resolve, spellings, wrapper_life
from hmp.core import torch_releases
from hmp.driver.queries import in_force
from hmp.testing import entries, expected_call

LOW = torch.bfloat16
MODES = ("constant", "reflect", "replicate", "circular")
# looked up at each call: a reference taken before convert() is torch's own function
PADS = {"torch._C._nn.pad": lambda: torch._C._nn.pad, "F.pad": lambda: F.pad}


class _Seen(TorchDispatchMode):
    """Each op dispatched: its name, device type and floating input dtypes."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        device = tensors[0].device.type if tensors else None
        self.ops.append((func._overloadpacket.__name__, device, tuple(t.dtype for t in tensors)))
        return func(*args, **(kwargs or {}))


def _call(via, x, sizes, mode):
    try:
        return PADS[via]()(x, sizes, mode=mode)
    except (RuntimeError, NotImplementedError, ValueError) as e:
        return type(e)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    mode=st.sampled_from(MODES),
    rank=st.integers(2, 5),
    pads=st.lists(st.integers(0, 2), min_size=1, max_size=3),
    via=st.sampled_from(sorted(PADS)),
)
def test_each_call_casts_as_autocast_does(mode, rank, pads, via):
    """Whatever the mode, rank and sizes: hmp's result is autocast's, dtype and bits (or the same error),
    and the testing kit's oracle says so."""
    x = torch.rand((3,) * rank, dtype=LOW)
    sizes = [p for p in pads for _ in (0, 1)]
    with torch.autocast("cpu", dtype=LOW):
        expected = _call(via, x, sizes, mode)
    with hmp.converted():
        got = _call(via, x, sizes, mode)
        oracle = None if isinstance(got, type) else expected_call(PADS[via](), x, sizes, mode=mode)
    if isinstance(expected, type):
        assert got is expected
        return
    assert got.dtype == expected.dtype, (mode, rank, sizes)
    assert torch.equal(got, expected)
    # the testing kit's oracle agrees (it runs torch's own op on the real arguments, not hmp's trace)
    assert (oracle.dtype or x.dtype) == got.dtype, oracle.rule


def test_the_kernel_reached_gets_its_lists_dtype():
    """reflect's kernel (FP32 list) sees float32; constant's (no list) the caller's bfloat16, untouched."""
    x = torch.rand(2, 3, 6, 6, dtype=LOW)
    with hmp.converted(), _Seen() as seen:
        reflected = F.pad(x, (1, 1, 1, 1), mode="reflect")
        constant = F.pad(x, (1, 1, 1, 1))
    kernels = {name: dtypes for name, device, dtypes in seen.ops if device == "cpu"}
    assert kernels["reflection_pad2d"] == (torch.float32,)
    assert kernels["constant_pad_nd"] == (LOW,)
    assert reflected.dtype == torch.float32 and constant.dtype == LOW
    assert torch.equal(constant, F.pad(x, (1, 1, 1, 1)))


def test_a_kind_of_call_is_traced_once():
    """The decision's trace (meta tensors) runs at the first call of each kind, never again."""
    x = torch.rand(2, 3, 6, 6, dtype=LOW)
    with hmp.converted():
        with _Seen() as first:
            F.pad(x, (1, 1, 1, 1), mode="replicate")
        with _Seen() as again:
            for _ in range(3):
                F.pad(torch.rand(2, 3, 7, 5, dtype=LOW), (1, 1, 1, 1), mode="replicate")
    assert any(device == "meta" for _, device, _ in first.ops)
    assert not any(device == "meta" for _, device, _ in again.ops)


class _Padded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x)
        return F.pad(y, (1, 1, 1, 1), mode="reflect"), F.pad(y, (1, 1, 1, 1))


@pytest.mark.parametrize("how", ["compile", "dynamic", "export"])
def test_compiled_and_exported_code_casts_what_eager_code_does(how):
    model, x = _Padded(), torch.randn(2, 3, 8, 8)
    with hmp.converted():
        eager = model(x)
        if how == "export":
            run = torch.export.export(model, (x,), strict=False).module()  # docs/integrations.md's form
        else:
            torch._dynamo.reset()
            # one graph where dynamo traces hmp's thread state (below, it breaks there: torch_releases)
            whole = torch_releases.BOUNDARIES["traced_state_writes"].present
            run = torch.compile(model, fullgraph=whole, backend="aot_eager", dynamic=how == "dynamic")
        got = run(x)
    assert [t.dtype for t in eager] == [torch.float32, LOW]
    assert [t.dtype for t in got] == [t.dtype for t in eager]
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)


def _listed():
    with hmp.converted():
        bound = entries.bound_names(in_force())
    return tuple((k.name, tuple(v)) for k, v in bound.items())  # the kinds by name, as the checks spell them


def test_only_ops_no_list_names_are_picked():
    """pad is picked under the default lists; nothing listed or spelled is; under float16 pad's own
    rule (it has no float16 kernel: the FP32 fallback) keeps it."""
    listed = _listed()
    builtins = aten.python_builtins()
    names = set(spellings.picked(listed, builtins, resolve.RNN_KERNELS))
    assert "pad" in names
    assert not names & {n for _, ns in listed for n in ns}
    assert not names & {s for *_, s in spellings.spellings(listed, builtins, resolve.RNN_KERNELS)}
    fallback = {n for _, ns in lists.fallback_names(torch.float16) for n in ns}
    with hmp.converted(low_precision_type=torch.float16):
        x = torch.rand(2, 3, 6, 6, dtype=torch.float16)
        assert F.pad(x, (1, 1, 1, 1), mode="reflect").dtype == torch.float32
    assert "pad" in fallback


def test_the_builtin_decides_and_python_functions_stay_torchs():
    """F.pad (Python) reaches the kernel through torch._C._nn.pad: only the builtin is wrapped, so a
    call is decided once; F.pad stays torch's own function."""
    original = F.pad
    with hmp.converted():
        assert F.pad is original
        assert wrapper_life.is_wrapper(torch._C._nn.pad)
    assert not wrapper_life.is_wrapper(torch._C._nn.pad)
