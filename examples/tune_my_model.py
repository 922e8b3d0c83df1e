"""Let ``hmp.tune`` fit the lists to your model: a training step in, list files out.

``make_step()`` returns ``(step, state)``: ``step`` is a zero-argument callable that runs one
training step and returns the loss; ``state`` is a tuple of the modules and optimizers the
step changes, which tune saves and puts back around each of its runs.

The model has a planted problem: its ``Standardize`` layer scales raw inputs of about 1000
(``x * inv_std``, a ``mul``: BF16 list) before subtracting their scaled mean, and bfloat16 keeps
only 8 bits of such a product. Tune measures each op and module against float32 (it flags
``mul`` and the ``Standardize`` class), proposes what to change (here: ``mul`` to the FP32
list), checks the proposal by training, and writes list files ``hmp.convert()`` loads.

Run:  python examples/tune_my_model.py
Also: python -m hmp tune examples/tune_my_model.py:make_step
"""

import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

import hmp


class Standardize(nn.Module):
    """(x - mean) / std written as x * inv_std - mean * inv_std, as some exported models have it."""

    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("inv_std", 1.0 / std)
        self.register_buffer("shift", mean / std)

    def forward(self, x):
        return x * self.inv_std - self.shift


def make_step(batch_size=64, seed=0):
    torch.manual_seed(seed)
    # raw sensor readings around 1000 with a spread of 2; the label depends on the small deviations
    signal = torch.randn(batch_size, 8)
    x = 1000.0 + 2.0 * signal
    y = (signal[:, :4].sum(dim=1) > 0).long()
    model = nn.Sequential(
        Standardize(torch.full((8,), 1000.0), torch.full((8,), 2.0)), nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return step, (model, optimizer)


def main():
    step, state = make_step()
    result = hmp.tune(step, state=state, steps=15, rounds=2)
    print(result.table())
    print()
    print(
        f"moved to FP32: {result.moved_to_fp32}; module classes to FP32: {result.modules_to_fp32}; "
        f"added to BF16: {result.added_to_bf16}"
    )
    with tempfile.TemporaryDirectory() as folder:
        bf16_file, fp32_file = os.path.join(folder, "tuned_bf16.txt"), os.path.join(folder, "tuned_fp32.txt")
        result.write(bf16_file, fp32_file)
        with hmp.converted(bf16_file_path=bf16_file, fp32_file_path=fp32_file):
            model = state[0]
            losses = [step().item() for _ in range(30)]
    print(
        f"30 steps with the tuned lists: loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
        f"parameters {sorted({str(p.dtype) for p in model.parameters()})}"
    )


if __name__ == "__main__":
    main()
