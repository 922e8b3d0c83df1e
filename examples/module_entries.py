"""Whole modules in float32: ``fp32_modules=`` and a list file that names a module class.

Shows: under the default lists every multiply inside an RMSNorm runs in bfloat16, so the
float32 upcast its authors wrote is lost; ``hmp.convert(fp32_modules=[RMSNorm])`` runs that
class in float32 (bit for bit what float32 gives) while the rest of the model stays in
bfloat16. The same from a list file: ``include default`` keeps the shipped FP32 list and one
more line names ``torch.nn.LayerNorm``. A module of one model, by name, works too.

Run:  python examples/module_entries.py
"""

import os
import tempfile

import torch
import torch.nn as nn

import hmp


class RMSNorm(nn.Module):
    """Llama-style: the authors upcast to float32 on purpose."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Model(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.norm = RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.final_norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 8)

    def forward(self, x):
        h = self.proj(x)
        h = h + self.mlp(self.norm(h))
        return self.head(self.final_norm(h))


def outputs(model, x):
    """Each submodule's (input, output), recorded with forward hooks."""
    seen = {}
    hooks = [
        module.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, (args[0], out)))
        for name, module in model.named_children()
    ]
    model(x)
    for hook in hooks:
        hook.remove()
    return seen


def describe(title, model, x):
    seen = outputs(model, x)
    print(f"{title}:")
    print("  " + ", ".join(f"{name} {str(out.dtype).replace('torch.', '')}" for name, (_, out) in seen.items()))
    norm_input, norm_output = seen["norm"]
    with hmp.disable_casts():
        expected = model.norm(norm_input)  # the RMSNorm as written, on the same input
    error = (norm_output.float() - expected).abs().max().item()
    print(f"  RMSNorm output vs float32 RMSNorm of the same input, max abs error: {error:.2e}")


def main():
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(16, 32) * 3
    with torch.no_grad():
        with hmp.converted():
            describe("default lists (O1)", model, x)

        with hmp.converted(fp32_modules=[RMSNorm]):
            describe("fp32_modules=[RMSNorm]", model, x)

        with tempfile.TemporaryDirectory() as folder:
            fp32_file = os.path.join(folder, "my_fp32.txt")
            with open(fp32_file, "w") as f:
                f.write(
                    "include default\n"  # the shipped FP32 list: losses, softmax, ...
                    "torch.nn.LayerNorm\n"  # every LayerNorm, whole, in float32
                    f"{__name__}.RMSNorm\n"
                )  # a class of this script, by its import path
            with hmp.converted(fp32_file_path=fp32_file):
                describe("list file naming torch.nn.LayerNorm and RMSNorm", model, x)
                modules = [e for e in hmp.effective_lists()["fp32"] if "." in e]
                print(f"  module entries in effective_lists()['fp32']: {modules}")

        with hmp.converted(fp32_modules=["head"], model=model):
            describe("fp32_modules=['head'] (a name in this model)", model, x)

    # training with a module entry: parameters and gradients stay float32
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with hmp.converted(fp32_modules=[RMSNorm]):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
    print(
        f"after a training step: parameters {sorted({str(p.dtype) for p in model.parameters()})}, "
        f"gradients {sorted({str(p.grad.dtype) for p in model.parameters()})}"
    )


if __name__ == "__main__":
    main()
