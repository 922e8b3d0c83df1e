"""The small models the tests share, defined once; a test keeps its own model where
its shape is the point of the test. Sizes are arguments: the tests differ by them."""

import torch
import torch.nn.functional as F


def mlp(d_in, hidden, d_out, act=torch.nn.ReLU, seed=None):
    """Linear -> LayerNorm -> ``act`` -> Linear as an ``nn.Sequential``: a matrix product hmp
    casts down, a normalisation, a pointwise op; seeded first when ``seed`` is given."""
    if seed is not None:
        torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(d_in, hidden), torch.nn.LayerNorm(hidden), act(), torch.nn.Linear(hidden, d_out)
    )


class LinearNormLinear(torch.nn.Module):
    """Linear(8, 16), LayerNorm(16) and Linear(16, 4) as ``fc1``, ``norm`` and ``fc2``,
    run as ``fc2(relu(norm(fc1(x))))``; a subclass may write its own forward."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.norm(self.fc1(x))))


class Block(torch.nn.Module):
    """Linear -> LayerNorm -> GELU -> Linear: a matrix product hmp casts down and a
    normalisation it keeps in float32 (a float32 island)."""

    def __init__(self, d_in, d):
        super().__init__()
        self.up = torch.nn.Linear(d_in, d)
        self.norm = torch.nn.LayerNorm(d)
        self.down = torch.nn.Linear(d, d)

    def forward(self, x):
        return self.down(F.gelu(self.norm(self.up(x))))


def blocks(d_in=16, d=32, classes=4, seed=0):
    """Two Blocks and a classifier head, seeded: each Block a unit FSDP can wrap."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(Block(d_in, d), Block(d, d), torch.nn.Linear(d, classes))


class Tied(torch.nn.Module):
    """A weight used twice per forward (tied embedding and head) plus a plain layer: the weight cache's model."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Parameter(torch.randn(6, 8) * 0.5)
        self.mid = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(F.linear(x, self.emb.t()))  # 6 -> 8 through the tied weight
        return F.linear(self.mid(h), self.emb)  # 8 -> 6 through it again


def tied_training():
    """The weight cache's training setup, the same each call: a seeded Tied
    model, three optimizers over it (fused, foreach and single-tensor
    updates write the weights three different ways) and an input."""
    torch.manual_seed(0)
    model = Tied()
    opts = {
        "fused": torch.optim.AdamW(model.parameters(), lr=0.05, fused=True),
        "foreach": torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True),
        "single": torch.optim.Adam(model.parameters(), lr=0.05, foreach=False),
    }
    return model, opts, torch.randn(4, 6)
