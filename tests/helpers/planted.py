"""Models with a planted numerically unsafe module, for tests/unit/tools/test_tune.py.

The module classes live here, at module level, so their import paths
(``helpers.planted.Recenter``) load from a list file while the tests run
(pytest puts ``tests/`` on ``sys.path``, as it does for ``conftest``).

``Recenter`` removes a large offset the raw inputs carry (think raw
timestamps or un-normalised sensor values) with ``sub``. With ``sub`` in
the BF16 list its input is rounded to bf16 first (spacing 4 near 1000) and
the signal is gone. ``Center`` uses the same ``sub`` on values of order 1,
where bf16 costs nothing that matters.

``TimestepEmbedding`` (in ``Denoiser``) is a diffusion model's sinusoidal
embedding: no listed op's own error is large, the module's own code still
ruins its output (docs/modules.md, "Sinusoidal embeddings").
"""

import math

import torch
from torch import nn

OFFSET = 1000.0


class Recenter(nn.Module):
    def __init__(self, offset):
        super().__init__()
        self.register_buffer("offset", torch.tensor(offset))

    def forward(self, x):
        return x - self.offset


class Center(nn.Module):
    def forward(self, h):
        return h - h.mean(dim=1, keepdim=True)


class Net(nn.Module):
    def __init__(self, features=16, hidden=64, classes=4):
        super().__init__()
        self.recenter = Recenter(OFFSET)
        self.fc1 = nn.Linear(features, hidden)
        self.act = nn.GELU()
        self.center = Center()
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(self.center(self.act(self.fc1(self.recenter(x)))))


class TimestepEmbedding(nn.Module):
    """A diffusion model's sinusoidal timestep embedding (as diffusers writes
    it): ``t * freqs`` then sin and cos. ``mul`` is in the BF16 list, so the
    product is rounded to bf16 (spacing 4 near 1000): a small relative error
    in the product, but sin and cos of a number near 1000 off by up to 2 are
    anything in [-1, 1]. No listed op's own error shows it; the module's
    output does."""

    def __init__(self, dim=16, max_period=10000.0):
        super().__init__()
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("freqs", freqs, persistent=False)

    def forward(self, t):
        emb = t[:, None].float() * self.freqs[None]
        return torch.cat([emb.sin(), emb.cos()], -1)


class Denoiser(nn.Module):
    """A tiny diffusion-style denoiser: the noisy sample and the timestep's
    embedding into an MLP that predicts the noise."""

    def __init__(self, features=8, dim=16, hidden=32):
        super().__init__()
        self.embed = TimestepEmbedding(dim)
        self.mlp = nn.Sequential(nn.Linear(features + dim, hidden), nn.SiLU(), nn.Linear(hidden, features))

    def forward(self, x, t):
        return self.mlp(torch.cat([x, self.embed(t)], -1))
