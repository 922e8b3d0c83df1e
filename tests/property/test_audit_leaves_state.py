"""After hmp.audit, everything the program can reach is bit for bit what it
was: a random model of modules and raw tensors, random optimizers over
them, a random training step.

"Everything reachable" is gathered here from torch's public API, not from
hmp's own snapshot code: parameters and buffers (named_buffers() includes
non-persistent ones), raw tensors, their gradients, every optimizer's
param_groups values and state tensors, the RNG; and which objects hold them
(a reassigned buffer, a param group, a state tensor are the same objects).
"""

import copy
import random

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hmp

WIDTH = 8
OPTIMIZERS = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
}


class Running(torch.nn.Module):
    """A running mean in a non-persistent buffer, updated in place, and a
    scale reassigned (a new tensor) on each call."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(WIDTH), persistent=False)
        self.register_buffer("scale", torch.ones(WIDTH))

    def forward(self, x):
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * x.mean(0))
            self.scale = 0.9 * self.scale + 0.1 * x.std(0)
        return (x - self.mean) / self.scale


def make_layer(kind):
    if kind == "linear":
        return torch.nn.Linear(WIDTH, WIDTH)
    if kind == "batchnorm":
        return torch.nn.BatchNorm1d(WIDTH)
    if kind == "running":
        return Running()
    return None  # "raw": a weight outside any module, used through F.linear


class Program:
    def __init__(self, draw):
        torch.manual_seed(draw(st.integers(0, 2**16)))
        layers = st.lists(st.sampled_from(["linear", "batchnorm", "running", "raw"]), max_size=3)
        self.kinds = draw(layers) + [draw(st.sampled_from(["linear", "raw"]))]  # something to train
        self.model = torch.nn.ModuleList([m for m in map(make_layer, self.kinds) if m is not None])
        self.raws = [(torch.randn(WIDTH, WIDTH) * 0.3).requires_grad_() for kind in self.kinds if kind == "raw"]
        self.dropout = draw(st.booleans())
        self.set_to_none = draw(st.booleans())
        trainable = list(self.model.parameters()) + self.raws
        owner = [draw(st.integers(0, 1)) for _ in trainable]  # which of two optimizers
        self.optimizers = []
        for i in range(2):
            mine = [p for p, o in zip(trainable, owner) if o == i]
            if not mine:
                continue
            kind = draw(st.sampled_from(sorted(OPTIMIZERS)))
            groups = [{"params": mine[::2]}] + ([{"params": mine[1::2], "lr": 0.05}] if mine[1::2] else [])
            self.optimizers.append(OPTIMIZERS[kind](groups, 0.01))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        self.x, self.y = torch.randn(16, WIDTH, generator=g), torch.randn(16, WIDTH, generator=g)
        for _ in range(draw(st.integers(0, 2))):  # optimizer state and running statistics to keep
            self.step(self.x, self.y)
        self.pass_raws = draw(st.booleans())

    def forward(self, x):
        modules, raws = iter(self.model), iter(self.raws)
        for kind in self.kinds:
            x = F.linear(x, next(raws)) if kind == "raw" else next(modules)(x)
            x = torch.relu(x)
        return F.dropout(x, 0.2) if self.dropout else x

    def step(self, x, y):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=self.set_to_none)
        loss = F.mse_loss(self.forward(x), y) + 1e-3 * random.random()
        loss.backward()
        for opt in self.optimizers:
            opt.step()
        return loss

    def reachable(self):
        """``{name: value}`` of everything the program can reach."""
        out = {"rng torch": torch.get_rng_state(), "rng python": random.getstate()}
        tensors = [(f"parameter {n}", t) for n, t in self.model.named_parameters()]
        tensors += [(f"buffer {n}", t) for n, t in self.model.named_buffers()]
        tensors += [(f"raw {i}", t) for i, t in enumerate(self.raws)]
        for name, t in tensors:
            out[name] = t
            out[f"{name} grad"] = t.grad
        for i, opt in enumerate(self.optimizers):
            for j, group in enumerate(opt.param_groups):
                for key, value in group.items():
                    out[f"optimizer {i} group {j} {key}"] = [id(p) for p in value] if key == "params" else value
            for p, state in opt.state.items():
                for key, value in state.items():
                    out[f"optimizer {i} state {id(p)} {key}"] = value
        return out

    def holders(self):
        """The objects the program holds, by identity."""
        return (
            [t for _, t in self.model.named_buffers()]
            + [t for _, t in self.model.named_parameters()]
            + [g for opt in self.optimizers for g in opt.param_groups]
            + [v for opt in self.optimizers for s in opt.state.values() for v in s.values()]
        )


def frozen(values):
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in values.items()}


def bit_identical(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.numel() else True
    return a == b


def test_bit_identical_sees_a_sign_flip():
    assert not bit_identical(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert bit_identical(torch.tensor([1.5]), torch.tensor([1.5]))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_audit_leaves_everything_reachable_bit_identical(data):
    program = Program(data.draw)
    state = [program.model, *program.optimizers] + (program.raws if program.pass_raws else [])
    before, holders = frozen(program.reachable()), program.holders()
    hmp.convert()
    try:
        hmp.audit(program.step, program.x, program.y, state=state)
    finally:
        hmp.revert()
    after = program.reachable()
    assert after.keys() == before.keys(), set(after) ^ set(before)
    changed = [k for k in before if not bit_identical(before[k], after[k])]
    assert changed == []
    assert all(a is b for a, b in zip(program.holders(), holders)) and len(program.holders()) == len(holders)
