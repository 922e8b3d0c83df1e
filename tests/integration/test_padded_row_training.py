"""A fully padded row of a BERT batch trains as in fp32 (docs/never-changes.md): its attention
mask fills every position with float32's minimum, which the casts to bf16 keep finite, so ten
AdamW steps of a tiny transformers model stay finite and end within 1 % of fp32's loss. The
single calls behind it: tests/unit/core/test_never_corrupt.py."""

import math

import pytest
import torch
from helpers import tiny_bert_config

import hmp


def test_bert_with_a_fully_padded_row_trains_like_fp32():
    transformers = pytest.importorskip("transformers")
    config = tiny_bert_config(heads=2, max_position_embeddings=16, num_labels=2, attn_implementation="eager")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (4, 8), generator=g)
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[0] = 0  # an empty example: every position padded
    labels = torch.tensor([0, 1, 1, 0])

    def train(convert):
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        if convert:
            hmp.convert()
        try:
            for _ in range(10):
                opt.zero_grad()
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                loss.backward()
                assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
                opt.step()
                losses.append(loss.item())
        finally:
            hmp.revert()
        return losses

    fp32, mixed = train(False), train(True)
    assert all(math.isfinite(v) for v in mixed)
    assert abs(mixed[-1] - fp32[-1]) <= 0.01 * abs(fp32[-1]), (fp32, mixed)
