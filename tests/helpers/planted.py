"""Models with a planted numerically unsafe module, for tests/unit/test_tune.py.

The module classes live here, at module level, so their import paths
(``helpers.planted.Recenter``) load from a list file while the tests run
(pytest puts ``tests/`` on ``sys.path``, as it does for ``conftest``).

``Recenter`` removes a large offset the raw inputs carry (think raw
timestamps or un-normalised sensor values) with ``sub``. With ``sub`` in
the BF16 list its input is rounded to bf16 first (spacing 4 near 1000) and
the signal is gone. ``Center`` uses the same ``sub`` on values of order 1,
where bf16 costs nothing that matters.
"""

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
