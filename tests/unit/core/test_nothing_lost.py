"""Nothing lost: parameters, gradients, BatchNorm statistics and optimizer
state stay fp32 through training under hmp; a state_dict saved under hmp
reloads bit-identical in a fresh process without hmp; a crash inside a
wrapped op, inside disable_casts or inside a training step leaves casting
state (and the weight-cast cache) correct for the next step."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import clone_with_backward

import hmp

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.BatchNorm1d(32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 16),
        torch.nn.LayerNorm(16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 4),
    )


def data(seed=1, n=64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, x[:, :4] * 2 - x[:, 4:] + 0.1 * torch.randn(n, 4, generator=g)


def train(model, opt, steps, x, y):
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        with hmp.disable_casts():
            opt.step()
        losses.append(loss.item())
    return losses


def assert_all_fp32(model, opt):
    for name, p in model.named_parameters():
        assert p.dtype == FP32 and p.grad is not None and p.grad.dtype == FP32, name
        assert torch.isfinite(p).all() and torch.isfinite(p.grad).all(), name
    for name, b in model.named_buffers():
        expected = torch.int64 if name.endswith("num_batches_tracked") else FP32
        assert b.dtype == expected and torch.isfinite(b.float()).all(), name
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                assert value.dtype == FP32 and torch.isfinite(value).all(), key


OPTIMIZERS = {
    "sgd momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
}
CONFIGS = {"O1 bf16": dict(), "O2 bf16": dict(opt_level="O2"), "O1 fp16": dict(low_precision_type=FP16)}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_training_keeps_everything_fp32(config, optimizer):
    hmp.convert(**CONFIGS[config])
    model = make_model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = data()
    losses = train(model, opt, 30, x, y)
    assert losses[-1] < 0.5 * losses[0]
    assert_all_fp32(model, opt)
    keys = {
        "sgd momentum": ["momentum_buffer"],
        "adam": ["exp_avg", "exp_avg_sq"],
        "adamw amsgrad": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
    }[optimizer]
    for p in model.parameters():
        assert all(opt.state[p][k].dtype == FP32 for k in keys)
    after = model.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert set(changed) == set(before), f"not updated: {set(before) - set(changed)}"  # stats and weights moved


@pytest.mark.parametrize("strict", [False, True])
def test_batchnorm_statistics_match_fp32_on_the_inputs_it_computes_on(strict):
    """BN under hmp never rounds its float32 input (it is left to torch: output
    float32 too): its running statistics are fp32 BN's on the same inputs.
    Under strict=True (Habana's rule) it sees its input in bf16: the
    statistics fp32 BN tracks on the same bf16-rounded inputs."""
    torch.manual_seed(0)
    xs = [torch.randn(32, 8) * 3 + 1 for _ in range(20)]
    ours, reference = torch.nn.BatchNorm1d(8), torch.nn.BatchNorm1d(8)
    hmp.convert(strict=strict)
    for x in xs:
        assert ours(x).dtype == (BF16 if strict else FP32)
    hmp.revert()
    for x in xs:
        reference(x.bfloat16().float() if strict else x)
    assert ours.running_mean.dtype == FP32 and ours.running_var.dtype == FP32
    torch.testing.assert_close(ours.running_mean, reference.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.running_var, reference.running_var, rtol=1e-5, atol=1e-6)
    assert int(ours.num_batches_tracked) == 20


CHECK = r"""
import sys, torch
torch.set_num_threads(1)  # as the test process: the same reduction order, so the forward is bitwise equal
model_sd, ref_sd = torch.load(sys.argv[1]), torch.load(sys.argv[2])
opt_sd, opt_ref = torch.load(sys.argv[3]), torch.load(sys.argv[4])

def bits(t):
    return t.reshape(-1).contiguous().view(torch.uint8) if t.dtype != torch.bool else t

def same(a, b, where):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(bits(a), bits(b)), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where

same(model_sd, ref_sd, "model")
same(opt_sd, opt_ref, "optimizer")
model = torch.nn.Sequential(
    torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
    torch.nn.Linear(32, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
model.load_state_dict(model_sd, strict=True)
model.eval()
x, expected = torch.load(sys.argv[5])
out = model(x)
assert out.dtype == torch.float32 and torch.equal(out, expected)
assert all(v.dtype in (torch.float32, torch.int64) for v in model_sd.values())
assert "hmp" not in sys.modules
print("ok", len(model_sd), "tensors")
"""


def test_state_dict_saved_under_hmp_reloads_bit_identical_without_it(tmp_path):
    hmp.convert()
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = data()
    train(model, opt, 10, x, y)
    paths = {k: tmp_path / f"{k}.pt" for k in ("model", "model_ref", "opt", "opt_ref", "probe")}
    torch.save(model.state_dict(), paths["model"])  # while converted
    torch.save(opt.state_dict(), paths["opt"])
    hmp.revert()
    torch.save(model.state_dict(), paths["model_ref"])  # the reference: the same tensors, saved without hmp
    torch.save(opt.state_dict(), paths["opt_ref"])
    model.eval()
    probe = torch.randn(5, 8)
    torch.save((probe, model(probe)), paths["probe"])
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    res = subprocess.run(
        [sys.executable, str(script)] + [str(paths[k]) for k in ("model", "model_ref", "opt", "opt_ref", "probe")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("ok")


# -- crashes --------------------------------------------------------------------------------------


def _healthy_step(model, opt, x, y):
    assert hmp.casts_enabled()
    out = model(x)
    assert out.dtype == BF16
    loss = F.mse_loss(out.float(), y)
    opt.zero_grad()
    loss.backward()
    with hmp.disable_casts():
        opt.step()
    assert_all_fp32(model, opt)
    return loss.item()


class Crash(Exception):
    pass


def test_crash_inside_a_forward_hook_mid_model():
    hmp.convert()
    model, (x, y) = make_model(), data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    _healthy_step(model, opt, x, y)
    handle = model[3].register_forward_hook(lambda *a: (_ for _ in ()).throw(Crash("hook")))
    with pytest.raises(Crash):
        model(x)  # wrapped ops ran before the crash
    handle.remove()
    losses = [_healthy_step(model, opt, x, y) for _ in range(20)]
    assert losses[-1] < losses[0]


def test_crash_inside_a_wrapped_op_during_backward():
    def fail(g):
        torch.mm(g, g.t())  # a wrapped op, run by autograd
        raise Crash("backward")

    Fails = clone_with_backward(fail)

    hmp.convert()
    model, (x, y) = make_model(), data()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(Crash):
        Fails.apply(model(x)).float().sum().backward()
    assert hmp.casts_enabled()
    losses = [_healthy_step(model, opt, x, y) for _ in range(20)]
    assert losses[-1] < losses[0]


class DiesHalfway(torch.optim.SGD):
    def step(self, closure=None):  # torch's step hooks still run around it
        for p in self.param_groups[0]["params"]:
            p.data.mul_(-1)  # bypasses the version counter
        raise Crash("optimizer died")


def test_crash_inside_the_optimizer_step():
    """A step that dies halfway: casting is back on, and the weight-cast
    cache is emptied (a weight changed through .data, which the version
    counter does not see, is used fresh next time), also while the output of
    a forward that used the old copies is still alive."""
    hmp.convert()
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    first = lin(x)
    assert first.dtype == BF16 and lin(x) is not None  # cast copies are cached now, held by first's graph
    with pytest.raises(Crash):
        DiesHalfway(lin.parameters(), lr=0.1).step()
    assert hmp.casts_enabled()
    with hmp.disable_casts():
        expected = F.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16())
    assert torch.equal(lin(x), expected)


def test_crash_inside_a_wrapped_op_inside_disable_casts_inside_a_step():
    hmp.convert()
    model, (x, y) = make_model(), data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _attempt in range(3):
        try:
            with hmp.disable_casts():
                with hmp.disable_casts():
                    torch.mm(torch.ones(2, 3), torch.ones(2, 3))
        except RuntimeError:
            pass
        try:
            model(x[:, :3])  # wrong width: fails in the first wrapped linear
        except RuntimeError:
            pass
        assert hmp.casts_enabled()
        _healthy_step(model, opt, x, y)


def test_keyboard_interrupt_mid_step_leaves_state_correct():
    hmp.convert()
    model, (x, y) = make_model(), data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def interrupt(*_):
        raise KeyboardInterrupt

    handle = model[4].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        with hmp.disable_casts():
            model(x)
    handle.remove()
    assert hmp.casts_enabled()
    _healthy_step(model, opt, x, y)
