# A training script in the shape of Habana's Model-References hello_world/mnist.py
# from the years it used hmp (written for these tests; synthetic data instead of
# torchvision's MNIST download): --hmp flags, htcore.mark_step() around the
# backward and the optimizer step, and the debug import it never uses.
import argparse

import habana_frameworks.torch.core as htcore
import habana_frameworks.torch.utils.debug as htdebug  # noqa: F401  (imported, never used)
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 3, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example (Habana style)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--hpu", action="store_true", default=False, help="Use hpu device")
    parser.add_argument("--use_lazy_mode", action="store_true", default=False)
    parser.add_argument("--hmp", dest="is_hmp", action="store_true", help="enable hmp mode")
    parser.add_argument("--hmp-bf16", default="ops_bf16_mnist.txt", help="path to bf16 ops list in hmp O1 mode")
    parser.add_argument("--hmp-fp32", default="ops_fp32_mnist.txt", help="path to fp32 ops list in hmp O1 mode")
    parser.add_argument("--hmp-opt-level", default="O1", help="choose optimization level for hmp")
    parser.add_argument("--hmp-verbose", action="store_true", help="enable verbose mode for hmp")
    args = parser.parse_args()

    torch.manual_seed(1)
    device = torch.device("cpu")
    if args.hpu:
        from habana_frameworks.torch.utils.library_loader import load_habana_module

        load_habana_module()
        device = torch.device("hpu")

    if args.is_hmp:
        from habana_frameworks.torch.hpex import hmp

        hmp.convert(
            opt_level=args.hmp_opt_level,
            bf16_file_path=args.hmp_bf16,
            fp32_file_path=args.hmp_fp32,
            isVerbose=args.hmp_verbose,
        )

    # a learnable synthetic task: the label is the argmax of a fixed projection
    data = torch.randn(args.batch_size * 2, 1, 13, 13)
    target = (data.flatten(1) @ torch.randn(169, 10)).argmax(1)
    model = Net().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    model.train()
    losses = []
    for _step in range(args.steps):
        for i in range(0, len(data), args.batch_size):
            x, y = data[i : i + args.batch_size].to(device), target[i : i + args.batch_size].to(device)
            optimizer.zero_grad()
            output = model(x)
            loss = F.nll_loss(output, y)
            loss.backward()
            htcore.mark_step()
            optimizer.step()
            htcore.mark_step()
        losses.append(loss.item())
    print("loss", losses[0], losses[-1])
    print("dtypes", model.conv1(data[:2]).dtype, output.dtype, model.fc1.weight.dtype, model.fc1.weight.grad.dtype)


if __name__ == "__main__":
    main()
