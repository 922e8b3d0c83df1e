"""LlamaRMSNorm in the FP32 list brings a tiny transformers Llama's training loss at least as
close to fp32's (docs/modules.md): twelve AdamW steps under Habana's rule (strict=True, which runs
RMSNorm's multiplies in bf16), with the entry and without. The entry's dtypes on single calls:
tests/unit/binding/test_modules.py."""

import statistics

import pytest
import torch
from helpers import fp32_list_with
from helpers.rmsnorm_entry import IDS, RMSNORM, llama, llama_rmsnorm, record

import hmp

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def rmsnorm_error_under_o1(**kwargs):
    model = llama()
    seen, hooks = record(model, llama_rmsnorm())
    with hmp.converted(**kwargs):
        model(input_ids=IDS)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        return max((out.float() - m(x.float())).abs().max().item() for m, x, out in seen)


def loss_gaps(config, steps=12):
    """Relative gap to fp32's loss at each of ``steps`` AdamW steps."""
    losses = {}
    for name, kwargs in (("fp32", None), ("hmp", config)):
        model = llama()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        out = []
        with hmp.converted(**kwargs) if kwargs is not None else hmp.disable_casts():
            for _ in range(steps):
                loss = model(input_ids=IDS, labels=IDS).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.item())
        losses[name] = out
    return [abs(a - b) / b for a, b in zip(losses["hmp"], losses["fp32"])]


def test_rmsnorm_entry_brings_the_loss_at_least_as_close_to_fp32(tmp_path):
    assert rmsnorm_error_under_o1() == 0  # its ops are pointwise: they follow torch's promotion
    assert rmsnorm_error_under_o1(strict=True) > 1e-3  # Habana's rule: its multiplies run in bf16
    without = statistics.fmean(loss_gaps({"strict": True}))
    entry = fp32_list_with(tmp_path, RMSNORM)
    with_entry = statistics.fmean(loss_gaps({"strict": True, "fp32_file_path": entry}))
    assert with_entry <= without, (with_entry, without)
