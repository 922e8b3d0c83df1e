"""Fused kernels reached without a patched name follow the lists too."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hmp

GEMMS = {
    "addmm",
    "mm",
    "bmm",
    "linear",
    "matmul",
    "_transformer_encoder_layer_fwd",
    "_native_multi_head_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_attention_math",
    "baddbmm",
}


class AtenDtypes(TorchDispatchMode):
    """Records the floating input dtypes of every aten op that runs."""

    def __enter__(self):
        self.seen = []  # (aten op name, its floating input dtypes), in the order they ran
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = list(args) + list((kwargs or {}).values())
        self.seen.append(
            (
                func.overloadpacket.__name__,
                {a.dtype for a in inputs if isinstance(a, torch.Tensor) and a.is_floating_point()},
            )
        )
        return func(*args, **(kwargs or {}))


def encoder():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.1)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def gemm_dtypes(model, x):
    rec = AtenDtypes()
    with rec:
        out = model(x)
    return out, [(n, d) for n, d in rec.seen if n in GEMMS]


def test_eval_transformer_runs_matmuls_in_bf16():
    model = encoder().eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        ref, fp32_gemms = gemm_dtypes(model, x)
        assert fp32_gemms and all(d == {torch.float32} for _, d in fp32_gemms)
        hmp.convert()
        out, gemms = gemm_dtypes(model, x)
    names = {n for n, _ in gemms}
    assert "_transformer_encoder_layer_fwd" in names  # the fused fast path was taken
    assert gemms and all(d == {torch.bfloat16} for _, d in gemms), gemms
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.05)


def test_training_transformer_runs_matmuls_in_bf16():
    model = encoder().train()
    x = torch.randn(2, 5, 32)
    hmp.convert()
    out, gemms = gemm_dtypes(model, x)
    # torch's CPU math kernel for scaled_dot_product_attention upcasts bf16
    # inputs to fp32 for its own bmm calls (dropout on); that is inside torch
    linear_gemms = [(n, d) for n, d in gemms if n in ("mm", "addmm")]
    assert linear_gemms and all(d == {torch.bfloat16} for _, d in linear_gemms), gemms
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)


def test_fused_kernels_follow_linear_list(tmp_path):
    (tmp_path / "f.txt").write_text("linear\n")
    (tmp_path / "b.txt").write_text("mm\n")
    # linear in FP32, layer_norm in no list: the fused kernels follow linear
    hmp.convert(fp32_file_path=tmp_path / "f.txt", bf16_file_path=tmp_path / "b.txt")
    model = encoder().eval()
    with torch.no_grad():
        out, gemms = gemm_dtypes(model, torch.randn(2, 5, 32).bfloat16())
    assert out.dtype == torch.float32
    assert gemms and all(d == {torch.float32} for _, d in gemms), gemms
