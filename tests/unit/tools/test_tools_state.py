"""audit, tune and profile leave things as they found them (docs/tuning.md):
every tensor the step can change, the optimizers' own objects, schedulers,
the RNG and hmp's configuration; what they cannot put back is refused. A
step returns its loss in any of the shapes the tools accept alike."""

import random

import pytest
import torch
import torch.nn.functional as F
from helpers import training_step

import hmp
from hmp.binding.kinds import FP32, LOWER
from hmp.driver.queries import in_force


def data(seed=0, n=32, features=16, out=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randn(n, out, generator=g)


def same(a, b):
    """Bit for bit (0.0 and -0.0 differ)."""
    if a is None or b is None:
        return a is b
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a, b)
        and (not a.is_floating_point() or torch.equal(torch.signbit(a), torch.signbit(b)))
    )


def copies(tensors):
    return [(t.detach().clone(), None if t.grad is None else t.grad.clone()) for t in tensors]


def assert_unchanged(tensors, before):
    for i, (t, (value, grad)) in enumerate(zip(tensors, before)):
        assert same(t.detach(), value), f"tensor {i} changed"
        assert same(t.grad, grad), f"gradient of tensor {i} changed"


def test_raw_tensor_parameters_with_two_optimizers_are_restored():
    """``F.linear(x, w)`` with ``w`` in no module, one weight per optimizer:
    every run starts from the same weights, so the audit sees bf16's error
    (not the previous run's training) and leaves the weights as they were."""
    x, y = data()
    g = torch.Generator().manual_seed(1)
    w1 = (torch.randn(16, 16, generator=g) * 0.3).requires_grad_()
    w2 = (torch.randn(8, 16, generator=g) * 0.3).requires_grad_()
    sgd = torch.optim.SGD([w1], lr=0.5, momentum=0.9)
    adam = torch.optim.Adam([w2], lr=0.1)

    def step(x, y):
        sgd.zero_grad()
        adam.zero_grad()
        loss = F.mse_loss(F.linear(F.linear(x, w1).relu(), w2), y)
        loss.backward()
        sgd.step()
        adam.step()
        return loss

    step(x, y)  # optimizer state to keep
    before = copies([w1, w2])
    states = [{k: v.clone() for k, v in opt.state[w].items()} for opt, w in ((sgd, w1), (adam, w2))]
    hmp.convert()
    report = hmp.audit(step, x, y, state=(sgd, adam))
    assert report.output_error < 0.01 and report.flagged == []
    assert_unchanged([w1, w2], before)
    for (opt, w), saved in zip(((sgd, w1), (adam, w2)), states):
        assert opt.state[w].keys() == saved.keys() and all(same(opt.state[w][k], v) for k, v in saved.items())


class RunningNorm(torch.nn.Module):
    """Keeps its running mean, scale and a call count in buffers (with
    ``persistent=False``, state_dict() leaves them out) and reassigns one
    of them in forward."""

    def __init__(self, persistent, features=16, out=8):
        super().__init__()
        self.register_buffer("mean", torch.zeros(features), persistent=persistent)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long), persistent=persistent)
        self.register_buffer("scale", torch.ones(features), persistent=persistent)
        self.fc = torch.nn.Linear(features, out)

    def forward(self, x):
        self.calls += 1
        with torch.no_grad():
            self.mean.mul_(0.5).add_(x.mean(0) * 0.5 + 3.0)
            self.scale = self.scale * 0.9 + 0.1 * x.std(0)  # a new tensor in the buffer's place
        return self.fc((x - self.mean) / self.scale)


def audit_running_norm(persistent):
    x, y = data()
    torch.manual_seed(0)
    model = RunningNorm(persistent)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = mse_step(model, opt)
    buffers = dict(model.named_buffers())
    before = copies(buffers.values())
    hmp.convert()
    report = hmp.audit(step, x, y, state=(model, opt))
    assert int(model.calls) == 0
    assert all(model.get_buffer(name) is t for name, t in buffers.items())  # the same objects
    assert_unchanged(buffers.values(), before)
    return report


def test_non_persistent_buffers_are_restored():
    report = audit_running_norm(persistent=False)
    # each run starts from the same statistics: the audit reads as with persistent buffers
    persistent = audit_running_norm(persistent=True)
    assert report.output_error == persistent.output_error and report.flagged == persistent.flagged
    assert report.output_error < 0.05


def mse_step(model, opt):
    """One plain training step of ``model`` (an MSE loss)."""
    return training_step(model, opt, F.mse_loss)


def momentum_problem(seed=0):
    x, y = data(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, mse_step(model, opt), x, y


def test_kept_param_group_still_controls_the_optimizer():
    model, opt, step, x, y = momentum_problem()
    step(x, y)
    group = opt.param_groups[0]  # a hand-written warmup keeps this to set group["lr"]
    groups = opt.param_groups
    weight = model[0].weight
    buffer = opt.state[weight]["momentum_buffer"]
    hmp.convert()
    hmp.audit(step, x, y, state=(model, opt))
    assert opt.param_groups is groups and opt.param_groups[0] is group
    assert opt.state[weight]["momentum_buffer"] is buffer
    group["lr"] = 0.0
    buffer.zero_()
    before = weight.detach().clone()
    step(x, y)
    assert torch.equal(weight, before)  # the kept group (lr 0) and state tensor drive the real optimizer


def test_profile_restores_a_momentum_optimizer_and_the_model():
    model, opt, step, x, y = momentum_problem()
    params = list(model.parameters())
    before = copies(params)
    hmp.convert()
    report = hmp.profile(step, x, y, state=(model, opt))
    assert {r["op"] for r in report.rows()} >= {"linear"}
    assert_unchanged(params, before)
    assert len(opt.state) == 0  # no momentum buffer made by the profiled step is left


def test_profile_refuses_a_step_whose_state_it_was_not_given():
    model, opt, step, x, y = momentum_problem()
    params = list(model.parameters())
    before = copies(params)
    hmp.convert()
    with pytest.raises(RuntimeError, match=r"hmp\.profile: the step ran a torch\.nn\.modules\.container\.Sequential"):
        hmp.profile(step, x, y)
    with pytest.raises(RuntimeError, match=r"hmp\.profile: the step ran a torch\.optim\.sgd\.SGD\.step\(\)"):
        hmp.profile(step, x, y, state=(model,))
    assert_unchanged(params, before)


def test_unknown_state_object_is_refused_before_any_run():
    model, opt, step, x, y = momentum_problem()
    calls = []
    hmp.convert()
    with pytest.raises(TypeError, match=r"hmp\.audit: cannot save and restore state\[1\], a builtins\.object"):
        hmp.audit(lambda *a: calls.append(1) or step(*a), x, y, state=(model, object(), opt))
    assert calls == []


def test_state_is_restored_when_the_step_raises():
    model, opt, step, x, y = momentum_problem()
    step(x, y)
    params, buffers = list(model.parameters()), [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    before = copies(params + buffers)
    rng = torch.get_rng_state()
    calls = []

    def failing(x, y):
        calls.append(1)
        loss = step(x, y)
        torch.rand(3)
        if len(calls) == 3:
            raise RuntimeError("planted failure")
        return loss

    hmp.convert()
    with pytest.raises(RuntimeError, match="planted failure"):
        hmp.audit(failing, x, y, state=(model, opt))
    assert_unchanged(params + buffers, before)
    assert torch.equal(torch.get_rng_state(), rng)
    assert in_force().lists[LOWER] >= {"linear"} and hmp.casts_enabled()


def test_schedulers_and_rng_are_restored_passed_or_not():
    model, opt, step, x, y = momentum_problem()
    passed = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    found = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0)  # not passed: it drives opt

    def scheduled(x, y):
        loss = step(x, y)
        passed.step()
        found.step()
        random.random()
        return loss

    random.seed(3)
    state = random.getstate()
    lr, epochs = opt.param_groups[0]["lr"], (passed.last_epoch, found.last_epoch)
    hmp.convert()
    hmp.audit(scheduled, x, y, state=(model, opt, passed))
    assert (passed.last_epoch, found.last_epoch) == epochs
    assert opt.param_groups[0]["lr"] == lr
    assert random.getstate() == state


def test_a_dict_return_without_a_loss_is_refused_at_the_first_run():
    model, opt, step, x, y = momentum_problem()
    params = list(model.parameters())
    before = copies(params)
    calls = []

    def logits_only(x, y):
        calls.append(1)
        step(x, y)
        return {"logits": model(x)}

    hmp.convert()
    for tool in (hmp.audit, hmp.tune, hmp.profile):
        calls.clear()
        with pytest.raises(TypeError, match=r"the step returned a builtins\.dict; a step must return its loss"):
            tool(logits_only, x, y, state=(model, opt))
        assert calls == [1]  # refused after the first run, before measuring anything
    assert_unchanged(params, before)


def test_tune_takes_a_step_returning_a_model_output():
    """Hugging Face models return a ModelOutput (a dict with attributes);
    tune used to fail in float() after the whole audit."""
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    from dataclasses import dataclass
    from typing import Optional

    @dataclass
    class Output(modeling_outputs.ModelOutput):
        loss: Optional[torch.FloatTensor] = None
        logits: Optional[torch.FloatTensor] = None

    model, opt, step, x, y = momentum_problem()

    def hf_step(x, y):
        opt.zero_grad()
        logits = model(x)
        loss = F.mse_loss(logits, y)
        loss.backward()
        opt.step()
        return Output(loss=loss, logits=logits)

    hmp.convert()
    result = hmp.tune(hf_step, x, y, state=(model, opt), steps=3, rounds=1)
    assert set(result.validation) == {"fp32", "starting lists", "tuned lists"}
    assert abs(result.validation["starting lists"] - result.validation["fp32"]) < 0.01
    profiled = hmp.profile(hf_step, x, y, state=(model, opt))
    assert "linear" in {r["op"] for r in profiled.rows()}


# -- writing the list files --------------------------------------------------------------------------


def result():
    from hmp.tools.tuning import TuneResult

    lists = {"bf16": ["linear", "mm"], "fp32": ["softmax"], "promote": []}
    return TuneResult(lists, lists, None, {}, {"fp32": 1.0}, {})


def test_write_checks_both_paths_before_writing_either(tmp_path):
    bf16 = tmp_path / "b.txt"
    bf16.write_text("linear\n")
    (tmp_path / "file").write_text("")
    for fp32, why in [
        (tmp_path / "missing" / "f.txt", "does not exist"),
        (tmp_path / "file" / "f.txt", "is not a directory"),
        (tmp_path, "is a directory"),
    ]:
        with pytest.raises(ValueError, match=f"hmp.tune: cannot write .*{why}"):
            result().write(bf16, fp32)
        assert bf16.read_text() == "linear\n"  # the existing BF16 file is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.txt", "file"]


def test_write_rejects_one_file_for_both_lists(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.txt").symlink_to(tmp_path / "b.txt")
    for fp32 in (tmp_path / "b.txt", tmp_path / "sub" / ".." / "b.txt", tmp_path / "link.txt"):
        with pytest.raises(ValueError, match="are the same file"):
            result().write(tmp_path / "b.txt", fp32)
    assert not (tmp_path / "b.txt").exists()


def test_write_is_all_or_nothing_when_writing_fails(tmp_path, monkeypatch):
    from hmp.tools import files

    bf16, fp32 = tmp_path / "b.txt", tmp_path / "f.txt"
    bf16.write_text("old bf16\n")
    real, calls = files.os.fdopen, []

    def failing(fd, *args, **kwargs):
        calls.append(fd)
        if len(calls) == 2:
            files.os.close(fd)
            raise OSError(28, "No space left on device")
        return real(fd, *args, **kwargs)

    monkeypatch.setattr(files.os, "fdopen", failing)
    with pytest.raises(OSError, match="No space left"):
        result().write(bf16, fp32)
    monkeypatch.undo()
    assert bf16.read_text() == "old bf16\n" and not fp32.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.txt"]  # no temporary file left
    result().write(bf16, fp32)
    hmp.convert(bf16_file_path=bf16, fp32_file_path=fp32)
    assert in_force().lists[LOWER] == {"linear", "mm"} and in_force().lists[FP32] == {"softmax"}


def test_tune_cli_checks_its_output_paths_before_tuning(tmp_path, monkeypatch, capsys):
    from hmp.__main__ import main
    from hmp.tools import tuning

    def tune(*args, **kwargs):
        raise AssertionError("tuned before checking the output paths")

    monkeypatch.setattr(tuning, "tune", tune)
    missing = tmp_path / "missing" / "b.txt"
    assert main(["tune", "--bf16-out", str(missing), "--fp32-out", str(tmp_path / "f.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m hmp tune: error: cannot write") and "does not exist" in err
    assert "Traceback" not in err
    same = str(tmp_path / "l.txt")
    assert main(["tune", "--bf16-out", same, "--fp32-out", same]) == 2
    assert "are the same file" in capsys.readouterr().err
