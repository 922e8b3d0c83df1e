"""Spellings with a decomposition of their own and picked ops are decided call by call, by the kernels
each call reaches (hmp/binding/picked.py), with CPU torch.autocast as the oracle under hmp's transcription
of its lists (op_lists/autocast_cpu_*.txt): inner, tensordot, chain_matmul and einsum calls that reach
no listed kernel run as torch's, ones that reach one follow it; a reflect pad of any size follows its
kernel; compiled code decides as eager code does; F.linear's path gains nothing."""

import pytest
import torch
import torch.nn.functional as F

import hmp
from hmp.binding import aten, resolve, spellings
from hmp.core import torch_releases
from hmp.driver.queries import in_force
from hmp.testing import entries, expected_call

LOW = torch.bfloat16


def autocast_lists():
    return dict(
        bf16_file_path=str(hmp.list_path("autocast_cpu_bf16")),
        fp32_file_path=str(hmp.list_path("autocast_cpu_fp32")),
        promote_file_path=str(hmp.list_path("autocast_cpu_promote")),
    )


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


CALLS = {
    "inner 1-d (dot)": (torch.inner, lambda: (_r(64), _r(64, seed=1)), {}),
    "inner 0-d (mul)": (torch.inner, lambda: (_r(()), _r(64, seed=1)), {}),
    "inner 2-d (mm)": (torch.inner, lambda: (_r(8, 16), _r(4, 16, seed=1)), {}),
    "tensordot dims=2 (dot)": (torch.tensordot, lambda: (_r(16, 16), _r(16, 16, seed=1)), {"dims": 2}),
    "tensordot dims=0 (mm)": (torch.tensordot, lambda: (_r(16), _r(16, seed=1)), {"dims": 0}),
    "tensordot dims=1 (mm)": (torch.tensordot, lambda: (_r(8, 16), _r(16, 4, seed=1)), {"dims": 1}),
    "chain_matmul one (a copy)": (torch.chain_matmul, lambda: (_r(16, 16),), {}),
    "chain_matmul three (mm, mm)": (torch.chain_matmul, lambda: (_r(8, 8), _r(8, 8, seed=1), _r(8, 8, seed=2)), {}),
    "multi_dot 1-d": (torch.linalg.multi_dot, lambda: ([_r(64), _r(64, seed=1)],), {}),
    "einsum transpose": (torch.einsum, lambda: ("ij->ji", _r(8, 8)), {}),
    "einsum sum": (torch.einsum, lambda: ("i->", _r(4096)), {}),
    "einsum diagonal": (torch.einsum, lambda: ("ii->i", _r(8, 8)), {}),
    "einsum outer": (torch.einsum, lambda: ("i,j->ij", _r(8), _r(8, seed=1)), {}),
    "einsum product": (torch.einsum, lambda: ("ij,jk->ik", _r(8, 8), _r(8, 8, seed=1)), {}),
    "einsum product then outer": (torch.einsum, lambda: ("ij,jk,l->ikl", _r(4, 4), _r(4, 4, seed=1), _r(3)), {}),
}
# autocast rounds the product, then its mul with a float32 operand puts out float32: hmp gives the dtype,
# running the whole call as torch's (it casts a call's inputs, never a kernel inside it)
PARTLY_CAST = {"einsum product then outer"}
# hmp's default lists name dot (autocast's CPU lists do not): there a call that reaches dot casts
DEFAULT_DIFFERS = {"inner 1-d (dot)", "tensordot dims=2 (dot)"}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_call_runs_as_cpu_autocast_does(name):
    fn, make, kwargs = CALLS[name]
    with torch.autocast("cpu", LOW):
        expected = fn(*make(), **kwargs)
    with hmp.converted(**autocast_lists()):
        live = torch.linalg.multi_dot if name.startswith("multi_dot") else getattr(torch, fn.__name__)
        got = live(*make(), **kwargs)
        oracle = expected_call(live, *make(), **kwargs)
    assert got.dtype == expected.dtype, name
    if name not in PARTLY_CAST:
        assert torch.equal(got, expected), name
    assert (oracle.dtype or torch.float32) == got.dtype, (name, oracle.rule)


@pytest.mark.parametrize("name", sorted(DEFAULT_DIFFERS))
def test_under_the_default_lists_a_call_that_reaches_dot_casts(name):
    fn, make, kwargs = CALLS[name]
    with hmp.converted():
        live = getattr(torch, fn.__name__)
        assert live(*make(), **kwargs).dtype == LOW
        assert expected_call(live, *make(), **kwargs).dtype == LOW


def test_the_default_lists_leave_a_non_contracting_einsum_exact():
    x = _r(64, 64)
    with hmp.converted():
        for equation in ("ij->ji", "...ij->...ji", "ij->ij", "ii->i"):
            got = torch.einsum(equation, x)
            assert got.dtype == torch.float32 and torch.equal(got, torch.einsum(equation, x).clone())
            assert expected_call(torch.einsum, equation, x).left_to_torch
        assert torch.einsum("ij,jk->ik", x, x).dtype == LOW


def test_aliases_stay_decided_per_op_and_the_rest_per_call():
    """torch.linalg.matmul, true_divide, special.softmax take their entry's arguments and compute what it
    computes: each call follows the entry, with no trace. The others are decided per call."""
    with hmp.converted():
        bound = entries.bound_names(in_force())
    listed = tuple((k, tuple(v)) for k, v in bound.items())
    per_call = spellings.per_call(listed, aten.python_builtins(), resolve.RNN_KERNELS)
    assert {"einsum", "inner", "tensordot", "chain_matmul", "linalg_multi_dot"} <= per_call
    assert not per_call & {"linalg_matmul", "true_divide", "special_softmax", "special_log_softmax"}
    with hmp.converted():
        assert torch.linalg.matmul(_r(8), _r(8, seed=1)).dtype == LOW  # 1-d: dot, matmul's entry


@pytest.mark.parametrize("pad", [1, 500, 1023, 1024, 2048, 5000])
def test_a_reflect_pad_of_any_size_follows_its_kernel(pad):
    x = torch.rand(1, 2, 2 * pad + 3, dtype=LOW)
    with torch.autocast("cpu", LOW):
        expected = F.pad(x, (pad, pad), mode="reflect")
    with hmp.converted():
        got = F.pad(x, (pad, pad), mode="reflect")
        constant = F.pad(x, (pad, pad))
    assert got.dtype == expected.dtype == torch.float32
    assert torch.equal(got, expected)
    assert constant.dtype == LOW


def test_a_pad_larger_than_its_dimension_raises_as_torchs():
    x = torch.rand(1, 1, 10, dtype=LOW)
    with pytest.raises(RuntimeError) as plain:
        F.pad(x, (2000, 2000), mode="reflect")
    with hmp.converted(), pytest.raises(RuntimeError) as converted:
        F.pad(x, (2000, 2000), mode="reflect")
    assert str(converted.value).splitlines()[0] == str(plain.value).splitlines()[0]


def test_the_key_holds_no_size():
    from hmp.core.call_keys import key

    small, large = torch.rand(1, 3, 5), torch.rand(1, 300, 5000)
    assert key(("ij->ji", small), {}) == key(("ij->ji", large), {})
    assert key(("ij->ji", torch.rand(2, 1)), {}) != key(("ij->ji", torch.rand(2, 2)), {})


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_einsum_decides_as_eager(dynamic):
    def f(x, w):
        return torch.einsum("ij->ji", x), torch.einsum("ij,jk->ik", x, w)

    x, w = torch.randn(8, 8), torch.randn(8, 8)
    with hmp.converted():
        torch._dynamo.reset()
        whole = torch_releases.BOUNDARIES["traced_state_writes"].present
        t, p = torch.compile(f, fullgraph=whole, backend="aot_eager", dynamic=dynamic)(x, w)
    assert t.dtype == torch.float32 and torch.equal(t, x.t())
    assert p.dtype == LOW


def test_a_per_call_spelling_with_no_kernel_entry_to_reach_runs_as_torchs(tmp_path):
    """Lists whose entries include no kernel a per-call spelling may reach (a BF16 list of ``matmul``
    alone: a composite, whose spellings chain_matmul and einsum would be decided per call): the
    spelling is not bound, and convert() succeeds (it raised on such lists: the audit's trials)."""
    bf16 = tmp_path / "bf16.txt"
    bf16.write_text("matmul\n")
    fp32 = tmp_path / "fp32.txt"
    fp32.write_text("softmax\n")
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with hmp.converted(bf16_file_path=str(bf16), fp32_file_path=str(fp32), promote_file_path=str(fp32)):
        out = torch.chain_matmul(a, b)
        assert torch.matmul(a, b).dtype == torch.bfloat16
    assert out.dtype == torch.float32 and torch.equal(out, torch.chain_matmul(a, b))
