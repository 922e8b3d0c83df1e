"""The small models the tests share, defined once; a test keeps its own model where
its shape is the point of the test. Sizes are arguments: the tests differ by them."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


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


class ConvAttention(nn.Module):
    """conv1d, layer_norm, softmax over a matmul, bmm, an MLP (linear, gelu; checkpointed where
    ``recompute``), mv (CPU autocast has no kernel for it), log_softmax: ops of every list."""

    def __init__(self, d=16):
        super().__init__()
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.ln = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.v = nn.Parameter(torch.randn(d))

    def forward(self, x, recompute=False):
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)
        h = self.ln(x)
        a = torch.softmax(h @ h.transpose(-1, -2) / 4, -1)
        h = torch.bmm(a, h)
        mlp = lambda t: self.down(F.gelu(self.up(t)))  # noqa: E731
        h = h + (checkpoint(mlp, h, use_reentrant=False) if recompute else mlp(h))
        s = torch.mv(h.reshape(-1, h.shape[-1]), self.v)
        return F.log_softmax(h.float(), -1).sum() + s.float().sum()


class ListsBlock(nn.Module):
    """Ops of all three default lists: linear, relu, layer_norm (BF16), softmax (FP32), add (promote)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(16, 32), nn.Linear(32, 16), nn.LayerNorm(16)

    def forward(self, x):
        h = self.fc2(F.relu(self.fc1(x)))
        return self.norm(x + h * F.softmax(h, dim=-1))


class CheckpointedBlocks(nn.Module):
    """Two ListsBlocks between a Linear in and a head, each block under torch's checkpoint where
    ``mode`` (its use_reentrant) is not None."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode  # None, or use_reentrant
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([ListsBlock(), ListsBlock()])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h) if self.mode is None else checkpoint(block, h, use_reentrant=self.mode)
        return self.head(h)


class KVBlock(nn.Module):
    """Attention over a KV cache (q, k, v, o; ``cat`` onto the cache) and a GELU MLP."""

    def __init__(self, d):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x, past):
        k, v = self.k(x), self.v(x)
        if past is not None:
            k, v = torch.cat([past[0], k], 1), torch.cat([past[1], v], 1)
        a = torch.softmax(self.q(x) @ k.transpose(1, 2) / 4, -1) @ v
        x = x + self.o(a)
        return x + self.down(F.gelu(self.up(x))), (k, v)


class KVDecoder(nn.Module):
    """Embedding, KVBlocks and a head; ``forward(tokens, cache)`` writes each block's (k, v) into ``cache``:
    one token per call, as generate() runs it."""

    def __init__(self, vocab=32, d=16, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(KVBlock(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens, cache):
        x = self.emb(tokens).float()
        for i, block in enumerate(self.blocks):
            x, cache[i] = block(x, cache[i])
        return self.head(x)


class ProductSpellings(nn.Module):
    """Function, method and operator calls of BF16-list ops, a leaf module, an FP32-list op."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = F.relu(torch.mm(x, x.t())) + x.mm(x.t()) + x @ x.t()
        return self.lin(h), F.softmax(h, dim=-1)


class ConvNorm(nn.Module):
    """Conv2d(3, 4, 3) then BatchNorm2d(4), summed: a cast down, then an op that casts nothing."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.norm(self.conv(x)).sum()
