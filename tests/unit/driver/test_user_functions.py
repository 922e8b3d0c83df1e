"""Env-named list files, user-function decorators and register()."""

import types

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same, snapshot, write

import hmp

BF16, FP32 = torch.bfloat16, torch.float32


# -- environment variables ----------------------------------------------------------


def test_env_lists_used_when_no_path_given(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWER_LIST", str(write(tmp_path, "lower.txt", "linear\nsoftmax\n")))
    monkeypatch.setenv("FP32_LIST", str(write(tmp_path, "fp32.txt", "mm\n")))
    hmp.convert()
    assert hmp.effective_lists()["bf16"] == ["linear", "softmax"]
    assert hmp.effective_lists()["fp32"] == ["mm"]


def test_habana_autocast_env_names(tmp_path, monkeypatch):
    monkeypatch.setenv("PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST", str(write(tmp_path, "l.txt", "linear\n")))
    monkeypatch.setenv("PT_HPU_AUTOCAST_FP32_OPS_LIST", str(write(tmp_path, "f.txt", "softmax\n")))
    hmp.convert()
    assert hmp.effective_lists()["bf16"] == ["linear"] and hmp.effective_lists()["fp32"] == ["softmax"]
    # LOWER_LIST wins over the PT_HPU_AUTOCAST_ name
    monkeypatch.setenv("LOWER_LIST", str(write(tmp_path, "l2.txt", "mm\n")))
    hmp.convert()
    assert hmp.effective_lists()["bf16"] == ["mm"]


def test_explicit_argument_wins_over_env(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWER_LIST", str(write(tmp_path, "lower.txt", "mm\n")))
    hmp.convert(bf16_file_path=write(tmp_path, "arg.txt", "linear\n"))
    assert hmp.effective_lists()["bf16"] == ["linear"]


def test_env_list_errors_name_the_variable(tmp_path, monkeypatch, pristine):
    monkeypatch.setenv("FP32_LIST", str(write(tmp_path, "bad.txt", "sofmax\n")))
    with pytest.raises(
        ValueError, match=r"\$FP32_LIST.*bad\.txt.*\n.*line 1: unknown op 'sofmax'; did you mean softmax"
    ):
        hmp.convert()
    monkeypatch.setenv("FP32_LIST", str(tmp_path / "missing.txt"))
    with pytest.raises(OSError, match="FP32_LIST.*missing.txt"):
        hmp.convert()


# -- decorators ----------------------------------------------------------------------


@hmp.bf16_function
def scaled_matmul(a, b, scale=1.0):
    return torch.mm(a, b) * scale


def test_decorator_applied_before_convert():
    a = torch.randn(3, 3)
    assert scaled_matmul(a, a).dtype == FP32  # not converted: does nothing
    hmp.convert()
    assert scaled_matmul(a, a).dtype == BF16
    with hmp.disable_casts():
        assert scaled_matmul(a, a).dtype == FP32
    hmp.revert()
    assert scaled_matmul(a, a).dtype == FP32
    assert scaled_matmul.__name__ == "scaled_matmul"


def test_decorators_applied_after_convert():
    hmp.convert()

    @hmp.fp32_function
    def as_is(x):
        return x

    @hmp.promote_function
    def pair(x, y):
        return x, y

    x = torch.randn(2).bfloat16()
    assert as_is(x).dtype == FP32
    a, b = pair(x, torch.randn(2, dtype=torch.float64))
    assert a.dtype == b.dtype == torch.float64
    assert as_is(torch.tensor([1, 2])).dtype == torch.int64


def test_decorated_function_is_the_outermost_op():
    hmp.convert()

    @hmp.fp32_function
    def head(x, w):
        return F.linear(x, w)  # linear is in the BF16 list, but the outer function decides

    assert head(torch.randn(2, 4).bfloat16(), torch.randn(3, 4)).dtype == FP32


def test_decorator_uses_fp16_when_configured():
    hmp.convert(low_precision_type=torch.float16)
    a = torch.randn(3, 3)
    assert scaled_matmul(a, a).dtype == torch.float16


# -- register ---------------------------------------------------------------------------


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def fake_extension():
    ext = types.ModuleType("my_ext")
    ext.fused_gelu = lambda x, inplace=False: torch._C._nn.gelu(x)
    return ext


def test_register_extension_op_before_and_after_convert():
    ext = fake_extension()
    original = ext.fused_gelu
    hmp.register(ext, "fused_gelu", "bf16")
    try:
        x = torch.randn(4)
        assert ext.fused_gelu(x).dtype == FP32 and ext.fused_gelu is original  # not converted
        hmp.convert()
        assert ext.fused_gelu(x).dtype == BF16
        hmp.revert()
        assert ext.fused_gelu is original
        hmp.convert()  # applied again at every convert
        assert ext.fused_gelu(x).dtype == BF16
        ext2 = fake_extension()
        hmp.register(ext2, "fused_gelu", "fp32")  # after convert: applied at once
        assert ext2.fused_gelu(x.bfloat16()).dtype == FP32
    finally:
        hmp.unregister(ext, "fused_gelu")
        hmp.unregister(ext2, "fused_gelu")
    hmp.revert()
    assert ext.fused_gelu is original


def test_register_autograd_function_apply():
    before = Square.__dict__["apply"] if "apply" in Square.__dict__ else None
    hmp.register(Square, "apply", "bf16")
    try:
        hmp.convert()
        x = torch.randn(3, requires_grad=True)
        y = Square.apply(x)
        assert y.dtype == BF16
        y.float().sum().backward()
        assert x.grad.dtype == FP32
        with hmp.disable_casts():
            expect = 2 * x.detach()
        torch.testing.assert_close(x.grad, expect, atol=0.05, rtol=0.02)
    finally:
        hmp.unregister(Square, "apply")
        hmp.revert()
    assert ("apply" in Square.__dict__) == (before is not None)
    assert Square.apply(torch.randn(2)).dtype == FP32


def test_register_errors(pristine):
    with pytest.raises(ValueError, match="kind"):
        hmp.register(torch, "mm", "fp8")
    with pytest.raises(ValueError, match="no callable attribute"):
        hmp.register(types.ModuleType("m"), "missing", "bf16")


def test_revert_after_registration_is_pristine(pristine):
    ext = fake_extension()
    hmp.register(ext, "fused_gelu", "promote")
    try:
        hmp.convert()
    finally:
        hmp.unregister(ext, "fused_gelu")
    hmp.revert()
    assert_same(pristine, snapshot())
