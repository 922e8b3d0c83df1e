"""Habana's HMP tutorial script, as published, trains in bf16 under hmp."""

import torch
import torch.nn.functional as F

import hmp

BF16, FP32 = torch.bfloat16, torch.float32


def test_tutorial_script_trains_in_bf16(device):
    torch.manual_seed(0)
    hmp.convert(opt_level="O1", bf16_file_path="", fp32_file_path="", isVerbose=False)
    N, D_in, D_out = 64, 256, 32
    x = torch.randn(N, D_in, device=device)
    y = torch.randn(N, D_in, device=device) @ torch.randn(D_in, D_out, device=device) / 16
    model = torch.nn.Linear(D_in, D_out).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(60):
        y_pred = model(x)
        assert y_pred.dtype == BF16
        loss = F.mse_loss(y_pred, y)
        optimizer.zero_grad()
        loss.backward()
        with hmp.disable_casts():
            optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]
    for p in model.parameters():
        assert p.dtype == FP32 and p.grad.dtype == FP32
