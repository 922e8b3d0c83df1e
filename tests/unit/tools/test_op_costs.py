"""What tune reads of a step before it tries ops in bf16 (hmp/tools/op_costs.py):
which ops compute in float32 because the model's author asked for it, and what
each op costs, robust to a stall that lands on one run's call."""

import time

import pytest
import torch
import torch.nn.functional as F
from helpers import classification_problem

import hmp
from hmp.tools import host, op_costs

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class AuthorNorm(torch.nn.Module):
    """RMSNorm as transformers writes it: the variance in float32 on purpose."""

    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + 1e-6)
        return self.weight * h.to(dtype)


class Block(torch.nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.norm, self.fc = AuthorNorm(width), torch.nn.Linear(width, width)
        self.scores = torch.nn.Linear(width, width)

    def forward(self, x):
        h = self.fc(self.norm(x))
        running = torch.cumsum(self.scores(h), dim=-1, dtype=torch.float32)  # the author's float32 again
        mixed = torch.exp(-running.abs())  # in the same module: computed from it
        return x + torch.tanh(h) * mixed.mean(-1, keepdim=True)  # residual: the parent's, not the author's


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = Block(), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.block(x)
        return self.head(torch.sin(h))  # sin: in the root module, on a value no author asked float32 of


def problem():
    return classification_problem(Model, 8, 16)


def test_the_authors_float32_marks_the_ops_computed_from_it_in_that_module_only():
    model, opt, step, x, y = problem()
    with hmp.converted():
        costs = op_costs.measure(lambda: step(x, y), [model], runs=1)
    # the norm's pow, mean, add, rsqrt, mul after x.to(float32); cumsum(dtype=float32) and exp after it
    assert {"pow", "mean", "rsqrt", "cumsum", "exp"} <= costs.authored
    # the residual add's other input and sin in the parent are not the author's float32 ...
    assert "sin" not in costs.authored
    # ... and they were still timed as float32 ops
    assert {"sin", "pow", "mean"} <= set(costs.seconds)


def test_without_modules_a_mark_stays_with_the_values_computed_from_it():
    x = torch.randn(4, 8)

    def run():
        h = x.float()  # float32 already: the author wrote it anyway
        torch.exp(torch.sin(h))
        torch.cos(torch.randn(4, 8))  # a fresh value: no mark

    costs = op_costs.measure(run, [], runs=1)
    assert {"sin", "exp"} <= costs.authored and "cos" not in costs.authored


def test_a_stall_on_one_runs_call_does_not_make_that_op_expensive(monkeypatch):
    """Each call's median over the runs: a 1 s stall on the first call of the second timed run (a
    collection, a thread waking) leaves the op's cost at what its calls take. The clock is a counter
    (each reading 1 ms on), so the answer is known: 5 calls of 1 ms."""
    x = torch.randn(4, 8)

    class Clock:
        now, reads = 0.0, 0

        def perf_counter(self):
            self.reads += 1
            # two readings per call, and each timed run's wall time two more: the warm-up makes 10,
            # the first timed run 12, the second's start 1: reading 25 ends its first call
            self.now += 1e-3 + (1.0 if self.reads == 25 else 0.0)
            return self.now

    def run():
        for _ in range(5):
            torch.sin(x)

    monkeypatch.setattr(op_costs, "time", Clock())
    costs = op_costs.measure(run, [], runs=3)
    assert costs.seconds == {"sin": pytest.approx(5e-3)}
    assert op_costs.time.reads == 46  # the stall happened, inside a timed call
    assert costs.seconds["sin"] <= costs.step_seconds  # the step of the same runs: 11 ms each but the stalled


def test_tune_leaves_the_authors_float32_alone_unless_asked():
    model, opt, step, x, y = problem()
    result = hmp.tune(step, x, y, state=(model, opt), steps=2, rounds=1, min_share=0.0, progress=False)
    assert not set(result.trials) & {"pow", "mean", "rsqrt", "cumsum", "exp"}
    # (cumsum takes the bf16 output of a listed linear: not a float32 op under the lists, so no candidate)
    assert {"mean", "exp"} <= set(result.authored) and "mean" not in result.added_to_bf16
    assert "sin" in result.trials  # large enough (min_share=0) and no author asked float32 of its input
    assert "not tried in bf16: " in result.table() and "override_fp32=True" in result.table()
    forced = hmp.tune(
        step, x, y, state=(model, opt), steps=2, rounds=1, min_share=0.0, override_fp32=True, progress=False
    )
    assert {"mean", "exp"} <= set(forced.trials) and not forced.authored


def test_a_gain_the_op_could_not_make_is_not_kept():
    """A step that is 30 ms slower whenever cat is not in the BF16 list: a machine-made difference,
    as load that happens to fall on one configuration is. The gain is beyond chance (every pair), but
    more than cat's whole fp32 time (microseconds) could save, so tune does not keep it. Measured on a
    host whose counters say nothing else ran (host.quiet()): the logic is under test, not this machine."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))

    def step():
        if "cat" not in hmp.effective_lists()["bf16"]:
            time.sleep(0.03)
        loss = F.cross_entropy(head(torch.cat([x, x.flip(0)], dim=1)), y)  # cat takes float32: a candidate
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    with host.on(host.quiet()):
        result = hmp.tune(step, state=(head, opt), steps=2, rounds=5, min_share=0.0, progress=False)
    cat = result.trials["cat"]
    assert cat["time_ratio"].surely_faster and cat["ceiling"] < 0.01  # measured faster, by far more than cat costs
    assert not cat["accepted"] and "cat" not in result.added_to_bf16
    assert cat["outcome"] == "gain is noise" and "more than the op's whole fp32 time" in cat["why"]
