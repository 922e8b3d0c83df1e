"""The cast rules on single calls: BF16 and FP32 lists, norms, in-place and
out= calls, autograd through casts, unlisted ops, fp16, op_wrap helpers, and
norm kernels that reject mixed dtypes."""

import pytest
import torch
import torch.nn.functional as F

import hmp

BF16, FP32 = torch.bfloat16, torch.float32


def test_bf16_list_casts_only_fp32():
    hmp.convert()
    a64 = torch.randn(3, 3, dtype=torch.float64)
    assert torch.mm(a64, a64).dtype == torch.float64
    ints = torch.ones(3, 3, dtype=torch.int64)
    assert torch.mm(ints, ints).dtype == torch.int64


def test_fp32_list_casts_lower_to_fp32():
    hmp.convert()
    x = torch.randn(2, 5).bfloat16()
    assert F.softmax(x, dim=-1).dtype == FP32
    assert x.softmax(-1).dtype == FP32
    assert F.cross_entropy(x, torch.tensor([1, 2])).dtype == FP32
    assert x.half().log().dtype == FP32


def _plain_or_promoted(module, x):
    """Oracle: what plain torch gives for ``module(x)``, or, where its kernel
    rejects a bf16 input with float32 parameters (CUDA's layer_norm), the same
    call on the float32 input (torch's type promotion)."""
    with hmp.disable_casts(), torch.no_grad():
        try:
            return module(x)
        except RuntimeError:
            return module(x.float())


def test_norms_are_left_to_torch_and_strict_casts_only_the_input(device):
    hmp.convert()
    x = torch.randn(8, 4, 5, device=device)
    for module in (torch.nn.BatchNorm1d(4), torch.nn.LayerNorm(5), torch.nn.GroupNorm(2, 4)):
        module = module.to(device).eval()
        assert module(x).dtype == FP32  # a float32 input is never rounded
        low = x.bfloat16()
        expected = _plain_or_promoted(module, low)
        out = module(low)  # bf16 data (a convolution's output): as torch runs it
        assert out.dtype == expected.dtype and torch.equal(out, expected), type(module).__name__
    hmp.convert(strict=True)  # Habana's rule: the input is cast, parameters and statistics keep their dtype
    bn = torch.nn.BatchNorm1d(4).to(device)
    before = bn.running_mean.clone()
    assert bn(x).dtype == BF16
    assert bn.running_mean.dtype == FP32 and bn.weight.dtype == FP32
    assert not torch.equal(before, bn.running_mean)  # running stats keep updating
    with hmp.disable_casts():
        expect = x.mean(dim=(0, 2)) * bn.momentum
    torch.testing.assert_close(bn.running_mean, expect, atol=2e-2, rtol=2e-2)
    ln = torch.nn.LayerNorm(5).to(device)
    assert ln(x).dtype == BF16 and ln.weight.dtype == FP32
    gn = torch.nn.GroupNorm(2, 4).to(device)
    assert gn(x).dtype == BF16


def test_inplace_keyword_writes_the_users_tensor():
    hmp.convert()
    x = torch.randn(4, 4)
    y = F.relu(x, inplace=True)
    assert y is x and x.dtype == FP32 and (x >= 0).all()
    x = torch.randn(4, 4)
    y = F.relu(x, True)  # positional inplace
    assert y is x and x.dtype == FP32
    x = torch.ones(100)
    y = F.dropout(x, 0.5, True, True)
    assert y is x and x.dtype == FP32 and (x == 0).any()


def test_out_argument_is_written():
    hmp.convert()
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    out = torch.empty(3, 3)
    res = torch.mm(a, b, out=out)
    assert res is out and out.dtype == FP32
    with hmp.disable_casts():
        expect = torch.mm(a, b)  # the in-place rule: inputs take the dtype of out
    assert torch.equal(out, expect)


def test_inplace_update_of_fp32_parameter_stays_fp32():
    hmp.convert()
    p = torch.nn.Parameter(torch.randn(4))
    with torch.no_grad():
        p.mul_(torch.randn(4).bfloat16())
        p += torch.ones(4).bfloat16()
        p *= 2
    assert p.dtype == FP32 and isinstance(p, torch.nn.Parameter)


def test_autograd_flows_through_casts(device):
    hmp.convert()
    w = torch.randn(3, 4, device=device, requires_grad=True)
    x = torch.randn(2, 4, device=device, requires_grad=True)
    y = F.linear(x, w)
    assert y.dtype == BF16
    F.softmax(y, -1)[:, 0].sum().backward()
    assert w.grad.dtype == FP32 and x.grad.dtype == FP32
    assert torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0


def test_unlisted_ops_are_untouched():
    hmp.convert()
    assert torch.sin is vars(torch)["sin"] and not hasattr(torch.sin, "__hmp_original__")
    x = torch.randn(3).bfloat16()
    assert torch.sin(x).dtype == BF16


def test_fp16_low_precision(device):
    hmp.convert(low_precision_type=torch.float16)
    x = torch.randn(2, 4, device=device)
    assert F.linear(x, torch.randn(3, 4, device=device)).dtype == torch.float16
    assert F.softmax(x.half(), -1).dtype == FP32


def test_op_wrap_and_cast_helpers():
    def my_op(a, b, scale=None):
        return a * b if scale is None else a * b * scale

    wrapped = hmp.op_wrap(my_op, hmp.to_bf16)
    x, y = torch.randn(3), torch.randn(3)
    assert wrapped(x, y).dtype == BF16
    assert wrapped(x, y, scale=torch.ones(3)).dtype == BF16
    with hmp.disable_casts():
        assert wrapped(x, y).dtype == FP32
    assert hmp.to_fp32(x.bfloat16()).dtype == FP32 and hmp.to_fp32(x.half()).dtype == FP32
    assert hmp.to_bf16(x.double()).dtype == torch.float64
    assert hmp.to_bf16(3) == 3
    assert wrapped.__name__ == "my_op"


def test_layer_norm_kernel_gets_fp32_weight_on_cpu():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "layer_norm" in func.overloadpacket.__name__:
                self.calls.append([a.dtype for a in args if isinstance(a, torch.Tensor)])
            return func(*args, **(kwargs or {}))

    hmp.convert()
    ln = torch.nn.LayerNorm(6)
    seen = Seen()
    with seen:
        ln(torch.randn(2, 6).bfloat16())  # a bf16 input: the mixed kernel
        ln(torch.randn(2, 6))  # a float32 input is never rounded: float32 throughout, the output rounded
    assert seen.calls == [[BF16, FP32, FP32], [FP32, FP32, FP32]]


def test_norm_falls_back_where_a_kernel_rejects_mixed_dtypes():
    """A stand-in for a device kernel (CUDA's layer_norm) that requires one dtype."""
    from hmp.binding import sites
    from hmp.core import cast_copies, policy

    calls = []

    def strict_layer_norm(x, shape, weight, bias, eps=1e-5):
        calls.append((x.dtype, weight.dtype))
        if x.dtype != weight.dtype:
            raise RuntimeError(f"expected scalar type {x.dtype} but found {weight.dtype}")
        return torch.ones_like(x)

    lower_all = policy.lower(BF16, cast_copies.ROUNDING_CASTS)  # strict=True: the input was cast down
    call = sites.one_dtype_on_reject(strict_layer_norm, lower_all)
    x, w, b = torch.randn(2, 4).bfloat16(), torch.randn(4), torch.randn(4)
    assert call(x, (4,), w, b).dtype == BF16
    assert calls == [(BF16, FP32), (BF16, BF16)]
    call(x, (4,), w, b)  # remembered for this device type: no failing first try
    assert calls[2:] == [(BF16, BF16)]
    assert w.dtype == FP32  # the user's weight is never changed
    calls.clear()  # by default the norm is torch's: the mix goes to the widest dtype, as promotion gives
    call = sites.one_dtype_on_reject(strict_layer_norm, policy.promote(BF16, cast_copies.ROUNDING_CASTS))
    assert call(x, (4,), w, b).dtype == FP32
    assert calls == [(BF16, FP32), (FP32, FP32)] and x.dtype == BF16
    calls.clear()  # what is remembered is the mix the kernel rejected, not the site: others run as given
    assert call(x, (4,), w.bfloat16(), b.bfloat16()).dtype == BF16 and calls == [(BF16, BF16)]
    call(x, (4,), w, b)
    assert calls[1:] == [(FP32, FP32)]  # the rejected mix goes straight to one dtype

    def shape_error(x, shape, weight, bias):
        raise RuntimeError("normalized_shape mismatch")

    with pytest.raises(RuntimeError, match="normalized_shape"):
        sites.one_dtype_on_reject(shape_error, lower_all)(x, (4,), w, b)
