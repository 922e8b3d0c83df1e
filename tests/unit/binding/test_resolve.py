"""Op names bind every place the op lives, resolved from torch itself."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from helpers import write

import hmp
from hmp.binding.resolve import Resolver
from hmp.core.identity import ORIGINAL


def labels(name):
    return {s.label for s in Resolver().sites(name)}


def test_mul_binds_function_method_dunders_and_inplace():
    assert {
        "torch.mul",
        "torch.Tensor.mul",
        "torch.Tensor.mul_",
        "torch.Tensor.__mul__",
        "torch.Tensor.__rmul__",
        "torch.Tensor.__imul__",
    } <= labels("mul")


def test_matmul_and_truediv_bind_operators():
    assert {"torch.matmul", "torch.Tensor.matmul", "torch.Tensor.__matmul__", "torch.Tensor.__rmatmul__"} <= labels(
        "matmul"
    )
    assert {"torch.Tensor.__truediv__", "torch.Tensor.__rtruediv__", "torch.Tensor.__itruediv__"} <= labels("truediv")


def test_relu_binds_functional_and_inplace_forms():
    found = labels("relu")
    assert {
        "torch.relu",
        "torch.relu_",
        "torch.nn.functional.relu",
        "torch.nn.functional.relu_",
        "torch.Tensor.relu",
        "torch.Tensor.relu_",
    } <= found
    inplace = {s.label for s in Resolver().sites("relu") if s.inplace}
    assert inplace == {"torch.relu_", "torch.nn.functional.relu_", "torch.Tensor.relu_"}
    (f_relu,) = [s for s in Resolver().sites("relu") if s.label == "torch.nn.functional.relu"]
    assert f_relu.inplace_param == 1  # F.relu(input, inplace)


def test_operators_are_wrapped_after_convert():
    hmp.convert()
    assert torch.Tensor.__mul__ is torch._C.TensorBase.__mul__  # pointwise: torch's own, by default
    hmp.convert(strict=True)
    a, b = torch.randn(2, 3), torch.randn(3, 2)
    assert (a * 2).dtype == torch.bfloat16  # __mul__
    assert (2 * a).dtype == torch.bfloat16  # __rmul__
    assert (a @ b).dtype == torch.bfloat16  # __matmul__
    assert (a.bfloat16() / 2).dtype == torch.float32  # __truediv__ in the FP32 list
    for ns, attr in [(torch, "mul"), (F, "linear"), (torch.Tensor, "__mul__"), (torch.Tensor, "mul_")]:
        assert hasattr(getattr(ns, attr), ORIGINAL)


def test_private_names_resolve(tmp_path):
    assert labels("_native_multi_head_attention") == {"torch._native_multi_head_attention"}
    hmp.convert(bf16_file_path=write(tmp_path, "b.txt", "_native_multi_head_attention\nlinear\n"))
    assert "_native_multi_head_attention" in hmp.effective_lists()["bf16"]


@pytest.mark.parametrize("name", ["Tensor", "nn", "dtype", "float32", "_make_subclass", "T", "no_such_op"])
def test_non_ops_are_not_ops(name):
    assert not Resolver().exists(name)


def test_casts_never_recurse_through_a_wrapped_to():
    # a list may not name them (test_lists_hold_precision_choices_only); register() can wrap anything
    for name in ("to", "type", "float", "bfloat16"):
        hmp.register(torch.Tensor, name, "bf16")
    try:
        hmp.convert()
        x = torch.randn(4, 8)
        lin = torch.nn.Linear(8, 2)
        assert lin(x).dtype == torch.bfloat16
        assert x.float().dtype == torch.float32  # x.float() runs as a bf16-rule op on an fp32 input
        assert x.to(torch.float64).dtype == torch.float64
    finally:
        for name in ("to", "type", "float", "bfloat16"):
            hmp.unregister(torch.Tensor, name)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="torchvision not installed")
def test_torchvision_ops_bound(tmp_path):
    import torchvision

    assert "torchvision.ops.nms" in labels("nms")
    hmp.convert(fp32_file_path=write(tmp_path, "f.txt", "nms\nroi_align\n"))
    assert hasattr(torchvision.ops.nms, ORIGINAL)
    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11]], dtype=torch.bfloat16)
    keep = torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8], dtype=torch.bfloat16), 0.5)
    assert keep.tolist() == [0]
    hmp.revert()
    assert not hasattr(torchvision.ops.nms, ORIGINAL)


def test_inplace_operator_names_bind_as_inplace(tmp_path):
    """Habana's lists name `a += b` as `iadd`: it must write `a`, never a cast copy."""
    sites = Resolver().sites("iadd")
    assert {s.label for s in sites} == {"torch.Tensor.__iadd__"} and all(s.inplace for s in sites)
    hmp.convert(bf16_file_path=write(tmp_path, "b.txt", "iadd\nlinear\n"))
    a = torch.zeros(3)
    alias = a
    a += torch.ones(3).bfloat16()
    assert a is alias and a.dtype == torch.float32 and torch.equal(alias, torch.ones(3))
