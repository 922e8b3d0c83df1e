"""profile / audit / tune on a model with a planted numerically unsafe op.

The planted op: inputs carry a large offset (think raw timestamps or
un-normalised sensor values) that the model removes with ``torch.sub``. With
``sub`` in the BF16 list, the input is rounded to bf16 first (spacing 8
near 1000) and the signal is gone; in fp32 it survives.
"""

import json

import pytest
import torch
import torch.nn.functional as F

import hmp
from hmp.record import Recorder

OFFSET = 1000.0


@hmp.disable_casts()  # the data is made in fp32 even when a test calls this converted
def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 16, generator=g) * 0.5 + OFFSET
    w = torch.randn(16, 4, generator=g)
    y = ((x - OFFSET) @ w).argmax(1)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(torch.sub(x, OFFSET)), y)
        loss.backward()
        with hmp.disable_casts():
            opt.step()
        return loss

    return model, opt, step, x, y


@pytest.fixture
def unsafe_lists(tmp_path):
    from hmp.lists import default_path

    path = tmp_path / "bf16.txt"
    path.write_text(default_path("bf16.txt").read_text() + "sub\n")
    return path


def snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()], repr(opt.state_dict()), torch.get_rng_state())


def assert_same_state(before, model, opt):
    params, opt_state, rng = before
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert repr(opt.state_dict()) == opt_state
    assert torch.equal(rng, torch.get_rng_state())


def train(step, x, y, steps):
    for _ in range(steps):
        loss = step(x, y)
    return float(loss.detach())


def test_profile_reports_per_op_and_leaves_nothing_behind(tmp_path):
    model, opt, step, x, y = problem()
    hmp.convert()
    before = F.linear
    report = hmp.profile(step, x, y)
    assert F.linear.__hmp_original__ is before.__hmp_original__  # converted as before
    rows = {r["op"]: r for r in report.rows()}
    assert rows["linear"]["calls"] == 2 and rows["linear"]["ran_in"] == "bfloat16,bfloat16,bfloat16"
    assert rows["linear"]["casts"] >= 4 and rows["linear"]["bytes_cast"] > 0
    assert rows["cross_entropy"]["ran_in"].startswith("float32")
    assert "| linear | 2 |" in report.table()
    report.save(tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text())["ops"][0]["op"] in rows
    with pytest.raises(RuntimeError, match="convert"):
        hmp.revert()
        hmp.profile(step, x, y)


def test_recorder_is_gone_after_profile():
    model, opt, step, x, y = problem()
    hmp.convert()
    hmp.profile(step, x, y)
    # an ordinary wrapper: no recorder closure anywhere in the live conversion
    from hmp.state import runtime

    assert runtime.wrappers.recorder is None
    assert not any(isinstance(c.cell_contents, Recorder) for c in (F.linear.__closure__ or ()))


def test_audit_flags_the_planted_op_and_restores_state(unsafe_lists):
    model, opt, step, x, y = problem()
    hmp.convert(bf16_file_path=unsafe_lists)
    train(step, x, y, 2)  # some optimizer state to keep
    before = snapshot(model, opt)
    report = hmp.audit(step, x, y, state=(model, opt))
    assert report.flagged == ["sub"]
    rows = {r["op"]: r for r in report.rows}
    assert rows["sub"]["own_max_rel"] > 0.5
    assert rows["linear"]["own_max_rel"] < 0.05 and not rows["linear"]["flagged"]
    assert_same_state(before, model, opt)
    assert hmp.effective_lists()["bf16"][-2:] == ["sub", "t"]  # configuration restored


def test_audit_counts_inf_introduced(tmp_path):
    """fp16 overflows past 65504 where fp32 does not."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    x = torch.full((2, 4), 300.0)

    def forward(x):
        return torch.mul(model(x), 1000.0).sum()

    hmp.convert(low_precision_type=torch.float16)
    report = hmp.audit(forward, x, state=(model,))
    assert "mul" in report.flagged
    assert {r["op"]: r for r in report.rows}["mul"]["nonfinite"] > 0


@pytest.mark.slow
def test_tune_moves_the_planted_op_and_training_matches_fp32(unsafe_lists, tmp_path):
    model, opt, step, x, y = problem()
    start = snapshot(model, opt)
    hmp.convert(bf16_file_path=unsafe_lists)
    result = hmp.tune(step, x, y, state=(model, opt), steps=40, rounds=2)
    assert_same_state(start, model, opt)
    assert "sub" in result.moved_to_fp32 and "sub" in result.lists["fp32"] and "sub" not in result.lists["bf16"]
    v = result.validation
    assert abs(v["tuned lists"] - v["fp32"]) <= 0.02 * v["fp32"]

    result.write(tmp_path / "b.txt", tmp_path / "f.txt")
    assert (tmp_path / "b.txt").read_text().startswith("# written by hmp.tune")
    losses = {}
    for name, kwargs in [("fp32", None), ("unsafe", {"bf16_file_path": unsafe_lists}),
                         ("tuned", {"bf16_file_path": tmp_path / "b.txt", "fp32_file_path": tmp_path / "f.txt"})]:
        model, opt, step, x, y = problem()
        hmp.revert()
        if kwargs is not None:
            hmp.convert(**kwargs)
        losses[name] = train(step, x, y, 60)
    hmp.revert()
    assert abs(losses["tuned"] - losses["fp32"]) <= 0.02 * losses["fp32"]
    assert losses["unsafe"] > 1.5 * losses["fp32"]  # the planted op really hurts
