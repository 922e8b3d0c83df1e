"""Let ``hmp.tune`` fit the lists to your model: a training step in, list files out.

``make_step()`` returns ``(step, state)``: ``step`` is a zero-argument callable that runs one
training step and returns the loss; ``state`` is a tuple of the modules and optimizers the
step changes, which tune saves and puts back around each of its runs.

The model has a planted problem: its first layer is a ``Recentered`` linear layer that takes raw
readings of about 1000 (``F.linear``: BF16 list, so its input is rounded to bfloat16, whose step
at 1000 is 8, more than the readings' spread) and subtracts the offset only afterwards, as some
exported models have it. Tune measures each op and module against float32 (it flags ``linear``
there and the ``Recentered`` class), proposes what to change, checks the proposal by training,
and writes list files ``hmp.convert()`` loads.

Run:  python examples/tune_my_model.py
Also: python -m hmp tune examples/tune_my_model.py:make_step
"""

import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

import hmp


class Recentered(nn.Linear):
    """``W (x - offset) + b`` written as ``W x - W offset + b``: the offset folded into the bias."""

    def __init__(self, offset, features, out):
        super().__init__(features, out)
        self.register_buffer("offset", offset)

    def forward(self, x):
        return F.linear(x, self.weight) - F.linear(self.offset, self.weight) + self.bias


def make_step(batch_size=64, seed=0):
    torch.manual_seed(seed)
    # raw sensor readings around 1000 with a spread of 2; the label depends on the small deviations
    signal = torch.randn(batch_size, 8)
    x = 1000.0 + 2.0 * signal
    y = (signal[:, :4].sum(dim=1) > 0).long()
    model = nn.Sequential(Recentered(torch.full((8,), 1000.0), 8, 32), nn.ReLU(), nn.Linear(32, 2))
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
