"""A training script written for Habana's HMP, with only the import changed.

Shows: ``hmp.convert()`` with the same arguments Habana's HMP took, list files that
extend the default lists (``include default``), ``with hmp.disable_casts():`` around
the optimizer step as Habana's examples wrote it, and what runs in which dtype.

Run:  python examples/habana_migrated.py

A script that still says ``from habana_frameworks.torch.hpex import hmp`` (and calls
``htcore.mark_step()``) runs unchanged with ``python -m hmp run script.py``.
"""

import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

import hmp  # was: from habana_frameworks.torch.hpex import hmp


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_images(n=256, seed=0):
    """12x12 images whose class is the quadrant holding a bright square."""
    g = torch.Generator().manual_seed(seed)
    images = 0.3 * torch.randn(n, 1, 12, 12, generator=g)
    labels = torch.randint(0, 4, (n,), generator=g)
    for i, label in enumerate(labels.tolist()):
        r, c = 6 * (label // 2), 6 * (label % 2)
        images[i, 0, r + 1 : r + 5, c + 1 : c + 5] += 1.0
    return images, labels


def write_lists(folder):
    """List files that keep every default entry and change one thing each."""
    bf16 = os.path.join(folder, "my_bf16.txt")
    fp32 = os.path.join(folder, "my_fp32.txt")
    with open(bf16, "w") as f:
        f.write("include default\nmax_pool2d   # pooling only picks values: nothing to lose in bf16\n")
    with open(fp32, "w") as f:
        # named here, mul leaves the default BF16 list for this file's list
        f.write("include default\nmul\n")
    return bf16, fp32


def main():
    torch.manual_seed(0)
    device = torch.device("cpu")  # "hpu" in the Habana original
    images, labels = synthetic_images()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=32, shuffle=True)
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    with tempfile.TemporaryDirectory() as folder:
        bf16_path, fp32_path = write_lists(folder)
        hmp.convert(opt_level="O1", bf16_file_path=bf16_path, fp32_file_path=fp32_path, isVerbose=False)

    lists = hmp.effective_lists()
    print(
        f"max_pool2d in BF16 list: {'max_pool2d' in lists['bf16']}; "
        f"mul in FP32 list: {'mul' in lists['fp32']}, in BF16 list: {'mul' in lists['bf16']}"
    )

    for epoch in range(3):
        total = 0.0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            output = model(x)
            loss = F.nll_loss(output, y)
            optimizer.zero_grad()
            loss.backward()
            with hmp.disable_casts():  # Habana's examples did this; hmp's optimizer step is uncast anyway
                optimizer.step()
            total += loss.item() * len(y)
        print(f"epoch {epoch}: mean loss {total / len(images):.4f}")

    with torch.no_grad():
        features = torch.randn(4, 8 * 6 * 6)
        hidden = model.fc1(features)  # linear: BF16 list
        out = model(images[:4])  # ends in log_softmax: FP32 list
        with hmp.disable_casts():
            hidden_uncast = model.fc1(features)  # no casts in this block
    print(
        f"fc1 output: {hidden.dtype}; model output (log_softmax): {out.dtype}; "
        f"fc1 output inside disable_casts: {hidden_uncast.dtype}"
    )
    print(
        f"parameters: {sorted({str(p.dtype) for p in model.parameters()})}, "
        f"gradients: {sorted({str(p.grad.dtype) for p in model.parameters()})}"
    )

    hmp.revert()
    with torch.no_grad():
        accuracy = (model(images).argmax(dim=1) == labels).float().mean().item()
    print(f"after hmp.revert(): output {model(images[:1]).dtype}, training accuracy {accuracy:.2f}")


if __name__ == "__main__":
    main()
