"""One cast, one launch (issue 56): what hmp costs a GPU, counted on any machine.

On a GPU each dispatched op that computes is a kernel launch, and batch-1 work is bound by them.
A cast hmp makes off the CPU is one op, ``hmp::to_finite`` (hmp/core/saturating_cast.py), whose CUDA
implementation is one Triton kernel: these tests count kernels (hmp.tools.launches) on ``meta``
tensors, where nothing runs, beside plain torch's and torch.autocast's counts on CPU tensors (the
same decomposition of every op: the Llama here uses eager attention), and check the kernel's numbers
bit for bit in Triton's interpreter on the CPU. Counts, never times.
"""

import gc
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.nn.functional as F
from helpers import TRITON_INTERPRETER_PROBE, tiny_llama_config

import hmp
from hmp.core import saturating_cast
from hmp.core.cast_copies import FINITE_CASTS
from hmp.tools.launches import count

BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture
def converted():
    hmp.convert()
    try:
        yield
    finally:
        hmp.revert()


# -- per cast --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "kernels"),
    [
        (lambda t: t, 1),
        (lambda t: t.t(), 1),  # dense in another order: one run of memory
        (lambda t: t.reshape(4, 4, 4).permute(2, 0, 1), 1),
        (lambda t: t[:, ::2], 2),  # gaps: a contiguous copy, then the kernel
        (lambda t: t.double(), saturating_cast.STOCK_OPS),  # the kernel takes float32 sources
    ],
    ids=["contiguous", "transposed", "permuted", "strided", "float64"],
)
def test_a_cast_off_the_cpu_is_one_op_of_one_kernel(layout, kernels):
    t = layout(torch.empty(16, 4, device="meta"))
    counted = count(FINITE_CASTS[BF16].eager, t)
    assert dict(counted.ops) == {"hmp.to_finite": kernels}
    assert counted.kernels == kernels and counted.host_reads == 0
    assert counted.result.dtype is BF16 and counted.result.stride() == torch.empty_like(t, dtype=BF16).stride()


def test_autocasts_cast_is_one_kernel_and_hmps_cpu_cast_reads_the_range():
    """The bound: torch's cast is one ``_to_copy``. On the CPU hmp reads the range first (no device
    to wait for: one reduction, two reads), so it saturates only where a value lies beyond."""
    x = torch.randn(16, 4)
    assert dict(count(torch.Tensor.bfloat16, x).ops) == {"aten._to_copy": 1}
    cpu = count(FINITE_CASTS[BF16].eager, x)
    assert dict(cpu.ops) == {"aten._to_copy": 1, "aten.aminmax": 1} and cpu.host_reads == 2


# -- per converted call ------------------------------------------------------------------------------


def _linear_args(device):
    torch.manual_seed(0)
    return (
        torch.randn(8, 64, device=device),
        torch.nn.Parameter(torch.randn(64, 64, device=device)),
        torch.nn.Parameter(torch.randn(64, device=device)),
    )


def test_a_converted_linear_launches_what_autocast_launches(converted):
    meta = _linear_args("meta")
    hmp.revert()
    plain = count(F.linear, *meta)
    cpu = _linear_args("cpu")
    with torch.autocast("cpu", BF16):
        autocast = count(F.linear, *cpu)
    hmp.convert()
    with torch.no_grad():
        first = count(F.linear, *meta)
    assert plain.kernels == 1
    assert first.kernels == autocast.kernels == 4  # x, w, b cast; the product
    assert first.ops["hmp.to_finite"] == 3 and first.host_reads == 0


def test_a_weight_served_from_the_cache_costs_no_launch(converted):
    x, w, b = _linear_args("meta")
    with torch.no_grad(), hmp.frozen_weights():
        count(F.linear, x, w, b)
        again = count(F.linear, x, w, b)
        assert dict(again.ops) == {"hmp.to_finite": 1, "aten.addmm": 1}  # the activation's own cast, as autocast's
    out = F.linear(x, w, b)  # grad mode: the graph holds the weights' copies for its backward
    again = count(F.linear, x.clone(), w, b)  # a new activation: its own cast, the weights' served
    assert again.ops["hmp.to_finite"] == 1
    del out


# -- per forward of a small Llama -------------------------------------------------------------------


def _llama(device):
    transformers = pytest.importorskip("transformers")
    # eager attention: the same ops on meta and the CPU (sdpa picks by device)
    config = tiny_llama_config(vocab=256, hidden=64, max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    return model, torch.zeros(1, 16, dtype=torch.long, device=device)


def test_a_llama_forward_and_training_step_launch_no_more_than_autocast():
    model, ids = _llama("cpu")
    meta, meta_ids = _llama("meta")

    def forward(m, i):
        return m(i).logits

    def step(m, i, region=None):
        if region is None:
            out = m(i).logits.float().sum()
        else:
            with region:
                out = m(i).logits.float().sum()
        out.backward()

    with torch.no_grad():
        plain_cpu = count(forward, model, ids)
        try:
            plain_meta = count(forward, meta, meta_ids)
        except RuntimeError as e:  # torch < 2.5 refuses autocast(device_type="meta"), which the rotary embedding enters
            pytest.skip(f"this torch runs no Llama on meta tensors, without hmp: {e}")
        with torch.autocast("cpu", BF16):
            autocast = count(forward, model, ids)
    autocast_step = count(step, model, ids, torch.autocast("cpu", BF16))
    assert plain_meta.kernels == plain_cpu.kernels  # meta counts what the CPU runs
    hmp.convert()
    try:
        with torch.no_grad():
            inference = count(forward, meta, meta_ids)
        training = count(step, meta, meta_ids)
    finally:
        hmp.revert()
    added = inference.kernels - plain_meta.kernels
    assert added == inference.ops["hmp.to_finite"] > 0  # every kernel hmp adds is one cast's one kernel
    assert inference.kernels <= autocast.kernels, (inference.ops - autocast.ops, autocast.ops - inference.ops)
    assert training.kernels <= autocast_step.kernels
    assert inference.host_reads == training.host_reads == 0  # nothing waits for the device


# -- the kernel itself, in Triton's interpreter --------------------------------------------------------

_KERNEL_CHECK = TRITON_INTERPRETER_PROBE + textwrap.dedent(
    """
    from hmp.core import saturating_cast as sc

    assert sc.kernel() is not None
    runs = []
    launch = sc.launch
    def counted(*a, **kw):  # each call is one grid of the one kernel
        runs.append(1)
        return launch(*a, **kw)
    sc.launch = counted

    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, 1.0, 1.00390625, 65504.0, 65519.0, 65520.0, 3.3895313892515355e38,
                            3.39e38, 3.4e38, -3.4e38, 3.4028234663852886e38, float("inf"), -float("inf"),
                            float("nan"), -float("nan"), 1e-40, -1e-45, 6e-8, 3e-8])
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int32).view(torch.float32)
    top = torch.arange(0x7F7F0000, 0x7F7FFFFF + 1, 97, dtype=torch.int32).view(torch.float32)  # bf16's edge
    half_edge = torch.linspace(65000, 66000, 4001)
    x = torch.cat([special, bits, top, -top, half_edge, -half_edge, torch.randn(5000, generator=g) * 1e4])
    layouts = {"contiguous": x, "transposed": x[: 64 * 1000].view(64, 1000).t(),
               "permuted": x[: 8 * 16 * 500].view(8, 16, 500).permute(2, 0, 1), "strided": x[::3]}
    bad = 0
    for dtype in (torch.bfloat16, torch.float16):
        for name, t in layouts.items():
            runs.clear()
            y = sc._cast(t, dtype)
            want = sc.stock(t, dtype)  # torch's rounding, saturated with torch's ops: the oracle
            same = (y.view(torch.int16) == want.view(torch.int16)) | (y.isnan() & want.isnan())
            assert y.stride() == want.stride() or name == "strided", (name, y.stride(), want.stride())
            bad += int((~same).sum())
            assert len(runs) == 1, (name, runs)
    print("MISMATCHES", bad)
    """
)


def test_the_kernel_gives_torchs_bits_in_tritons_interpreter(tmp_path):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = tmp_path / "kernel_check.py"
    script.write_text(_KERNEL_CHECK)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    if "INTERPRETER COPIES WRONG" in done.stderr:
        pytest.skip("this Triton's interpreter gets a plain copy wrong: " + done.stderr.strip()[-200:])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "MISMATCHES 0" in done.stdout


# -- the op's gradient and the transforms that take torch's ops ----------------------------------


def test_the_ops_gradient_is_the_plain_casts():
    x = torch.randn(6, 5, requires_grad=True)
    y = saturating_cast.to_finite(x, BF16)  # on the CPU: the stock ops, through the registered op
    g = torch.randn(6, 5, dtype=BF16)
    y.backward(g)
    assert y.dtype is BF16 and torch.equal(y, x.detach().bfloat16())
    assert x.grad.dtype is F32 and torch.equal(x.grad, g.float())
    huge = torch.tensor([3.4e38, -3.4e38, float("inf"), float("nan")])
    top = torch.finfo(BF16).max
    assert saturating_cast.to_finite(huge, BF16).tolist()[:3] == [top, -top, float("inf")]


def test_an_eager_cast_reaches_each_devices_kernel_and_a_mode_sees_the_one_op():
    # run() picks the kernel by the tensor's device flags: a CPU tensor takes the registered op (its
    # stock ops saturate), a meta one the metadata kernel, and under a dispatch mode the mode sees the op
    huge = torch.tensor([3.4e38, -3.4e38, float("inf"), 1.0])
    top = torch.finfo(BF16).max
    assert saturating_cast.run(huge, BF16).tolist() == [top, -top, float("inf"), 1.0]
    meta = saturating_cast.run(torch.empty(3, 5, device="meta").t(), BF16)
    assert meta.is_meta and meta.dtype is BF16 and meta.shape == (5, 3) and meta.stride() == (1, 5)
    counted = count(saturating_cast.run, torch.empty(4, device="meta"), BF16)
    assert dict(counted.ops) == {"hmp.to_finite": 1}


@pytest.mark.parametrize("dtype", [BF16, torch.float16, F32, torch.float64])
def test_the_op_called_directly_casts_to_any_floating_dtype_and_keeps_finite_values_finite(dtype):
    x = torch.tensor([1.0, 3.4e38, -3.4e38, float("inf"), float("nan"), -2.5], dtype=torch.float64)
    y = torch.ops.hmp.to_finite(x, dtype)
    top = torch.finfo(dtype).max
    assert y.dtype is dtype
    assert torch.isfinite(y[:3]).all() and y[3] == float("inf") and y[4].isnan() and y[5] == -2.5
    assert torch.equal(y[:3], x[:3].clamp(-top, top).to(dtype))


def test_the_op_called_directly_names_what_it_casts_to():
    with pytest.raises(TypeError, match=r"hmp::to_finite casts to a floating dtype .*got torch.int32"):
        torch.ops.hmp.to_finite(torch.ones(2), torch.int32)


@pytest.mark.parametrize("transform", ["jacfwd", "jacrev", "vmap"])
def test_the_op_and_its_helper_under_functorch_are_the_plain_casts(transform):
    """Called directly, under forward-mode AD and functorch's transforms the op is the plain cast's
    values (saturated) and derivatives: the identity Jacobian."""
    t = torch.randn(3)
    for cast in (torch.ops.hmp.to_finite, saturating_cast.to_finite):

        def f(v, cast=cast):
            return cast(v, BF16).float()

        if transform == "vmap":
            got = torch.vmap(f)(torch.randn(4, 3).clamp(-1, 1) * 3.4e38)
            assert torch.isfinite(got).all()
            continue
        jac = getattr(torch.func, transform)(f)(t)
        assert torch.equal(jac, torch.eye(3)), (cast, jac)


def test_the_op_called_directly_has_the_plain_casts_gradient_and_tangent():
    import torch.autograd.forward_ad as fwAD

    x = torch.tensor([1.5, 3.4e38, -2.0], requires_grad=True)
    y = torch.ops.hmp.to_finite(x, BF16)
    y.float().sum().backward()
    assert torch.isfinite(y).all() and torch.equal(x.grad, torch.ones(3))
    with fwAD.dual_level():
        dual = fwAD.make_dual(torch.tensor([1.5, 3.4e38]), torch.tensor([2.0, 3.0]))
        out = fwAD.unpack_dual(torch.ops.hmp.to_finite(dual, BF16))
    assert torch.isfinite(out.primal).all() and out.tangent.tolist() == [2.0, 3.0]


def test_vmap_and_forward_ad_take_torchs_ops_off_the_cpu(converted):
    w = torch.empty(5, 4, device="meta")
    assert torch.vmap(lambda a: F.linear(a, w))(torch.empty(3, 8, 4, device="meta")).dtype is BF16
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(torch.empty(8, 4, device="meta"), torch.empty(8, 4, device="meta"))
        assert fwAD.unpack_dual(F.linear(dual, w)).tangent is not None  # the tangent went through


# -- no growth over conversions ---------------------------------------------------------------------------


def _held():
    """What hmp holds: objects of hmp's types and hmp's functions alive, and its weight copies."""
    gc.collect()

    def ours(o):
        module = o.__module__ if isinstance(o, types.FunctionType) else getattr(type(o), "__module__", None)
        return isinstance(module, str) and module.startswith("hmp")

    return sum(1 for o in gc.get_objects() if ours(o)), hmp.cache_bytes()


def test_what_hmp_holds_and_the_ops_per_step_are_the_same_after_1_and_100_conversions():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)

    def step():
        opt.zero_grad()
        model(x).float().sum().backward()
        opt.step()

    def one_round():
        hmp.convert()
        try:
            return count(step).ops
        finally:
            hmp.revert()

    first = one_round()
    held = _held()
    for _ in range(99):
        assert one_round() == first
    assert _held() == held
