"""profile / audit / tune on a model with a planted numerically unsafe op.

The planted op: inputs carry a large offset (think raw timestamps or
un-normalised sensor values) that the model removes with ``torch.sub``. With
``sub`` in the BF16 list, the input is rounded to bf16 first (spacing 4
near 1000) and the signal is gone; in fp32 it survives.

The planted module (tests/helpers/planted.py): the same subtraction inside one
module class, ``Recenter``, while ``sub`` also runs harmlessly in another
(``Center``). The fix is that class in FP32, not ``sub`` everywhere.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import planted

import hmp
from hmp.binding import wrapper_life
from hmp.binding.kinds import FP32, LOWER
from hmp.driver.queries import in_force
from hmp.tools.record import Recorder
from hmp.tools.tuning import TuneResult

OFFSET = planted.OFFSET


@pytest.fixture(autouse=True)
def habana_rule(monkeypatch):
    """The planted harms are pointwise ops (sub, mul) that the BF16 list casts
    under Habana's literal rule only: these tests run under it (HMP_STRICT=1)."""
    monkeypatch.setenv("HMP_STRICT", "1")


@hmp.disable_casts()  # the data is made in fp32 even when a test calls this converted
def problem(seed=0, module=False):
    """The planted op (``torch.sub`` in the step), or with ``module`` the
    planted module (planted.Net, whose Recenter does the subtraction)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 16, generator=g) * 0.5 + OFFSET
    w = torch.randn(16, 4, generator=g)
    y = ((x - OFFSET) @ w).argmax(1)
    torch.manual_seed(seed)
    if module:
        model = planted.Net()
    else:
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x if module else torch.sub(x, OFFSET)), y)
        loss.backward()
        with hmp.disable_casts():
            opt.step()
        return loss

    return model, opt, step, x, y


def module_problem(seed=0):
    return problem(seed, module=True)


def hooks_left(model):
    return [name for name, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]


@pytest.fixture
def unsafe_lists(tmp_path):
    from hmp.binding.lists import default_path

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


def tuned(make_problem, unsafe, rounds):
    """hmp.tune from the unsafe lists; the model and optimizer are as before afterwards."""
    model, opt, step, x, y = make_problem()
    start = snapshot(model, opt)
    hmp.convert(bf16_file_path=unsafe)
    result = hmp.tune(step, x, y, state=(model, opt), steps=40, rounds=rounds)
    assert_same_state(start, model, opt)
    return result


def losses_after(make_problem, unsafe, bf16, fp32, steps=60):
    """Final training losses from the same start: fp32, the unsafe lists,
    and the list files tune wrote (``bf16``, ``fp32``)."""
    losses = {}
    for name, kwargs in [
        ("fp32", None),
        ("unsafe", {"bf16_file_path": unsafe}),
        ("tuned", {"bf16_file_path": bf16, "fp32_file_path": fp32}),
    ]:
        model, opt, step, x, y = make_problem()
        hmp.revert()
        if kwargs is not None:
            hmp.convert(**kwargs)
        losses[name] = train(step, x, y, steps)
    hmp.revert()
    return losses


def test_profile_reports_per_op_and_leaves_nothing_behind(tmp_path):
    model, opt, step, x, y = problem()
    hmp.convert()
    before = F.linear
    report = hmp.profile(step, x, y, state=(model, opt))
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
        hmp.profile(step, x, y, state=(model, opt))


def test_recorder_is_gone_after_profile():
    model, opt, step, x, y = problem()
    hmp.convert()
    hmp.profile(step, x, y, state=(model, opt))
    # an ordinary wrapper: no recorder closure anywhere in the live conversion
    from hmp.core.state import runtime

    assert runtime.wrappers.recorder is None
    assert not any(isinstance(v, Recorder) for v in wrapper_life.fields(F.linear).values())


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
    assert "sub" in hmp.effective_lists()["bf16"]  # configuration restored


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
    result = tuned(problem, unsafe_lists, rounds=2)
    assert "sub" in result.moved_to_fp32 and "sub" in result.lists["fp32"] and "sub" not in result.lists["bf16"]
    v = result.validation
    assert abs(v["tuned lists"] - v["fp32"]) <= 0.02 * v["fp32"]

    result.write(tmp_path / "b.txt", tmp_path / "f.txt")
    assert (tmp_path / "b.txt").read_text().startswith("# written by hmp.tune")
    losses = losses_after(problem, unsafe_lists, tmp_path / "b.txt", tmp_path / "f.txt")
    assert abs(losses["tuned"] - losses["fp32"]) <= 0.02 * losses["fp32"]
    assert losses["unsafe"] > 1.5 * losses["fp32"]  # the planted op really hurts


def test_audit_names_the_unsafe_module_class(unsafe_lists):
    model, opt, step, x, y = module_problem()
    hmp.convert(bf16_file_path=unsafe_lists)
    train(step, x, y, 2)
    before = snapshot(model, opt)
    report = hmp.audit(step, x, y, state=(model, opt))
    assert report.flagged == ["sub"]
    assert report.flagged_modules == ["helpers.planted.Recenter"]
    modules = {r["path"]: r for r in report.modules}
    assert set(modules) == {"", "recenter", "fc1", "act", "center", "fc2"}
    assert modules["recenter"]["own_op"] == "sub" and modules["recenter"]["own_max_rel"] > 0.5
    # Center's sub sees the garbage Recenter passed on (its output drifts), but its own error is small
    assert modules["center"]["max_rel"] > 0.5 and modules["center"]["own_max_rel"] < 0.05
    assert modules["fc1"]["class"] == "torch.nn.modules.linear.Linear" and modules["fc1"]["calls"] == 1
    classes = {r["class"]: r for r in report.module_classes}
    assert classes["torch.nn.modules.linear.Linear"]["instances"] == 2
    assert not classes["helpers.planted.Center"]["flagged"] and classes["helpers.planted.Recenter"]["flagged"]
    sub = next(r for r in report.rows if r["op"] == "sub")
    assert sub["own_by_module"]["recenter"] > 0.5 and sub["own_by_module"]["center"] < 0.05
    lines = report.table().splitlines()
    ops, top_module, top_class = [lines[i + 1] for i, line in enumerate(lines) if line.startswith("|---")]
    assert top_module.startswith("| recenter | helpers.planted.Recenter | 1 |")
    assert top_class.startswith("| helpers.planted.Recenter | 1 | 1 |") and top_class.endswith(
        "| sub error 0.96 > 0.05 |"
    )
    assert hooks_left(model) == []
    assert_same_state(before, model, opt)


def test_audit_pairs_calls_within_modules(unsafe_lists):
    """With Recenter in FP32, its sub is not recorded under hmp: Center's call
    is still paired with Center's call of the fp32 run, so nothing is flagged."""
    model, opt, step, x, y = module_problem()
    hmp.convert(bf16_file_path=unsafe_lists, fp32_modules=[planted.Recenter])
    report = hmp.audit(step, x, y, state=(model, opt))
    rows = {r["op"]: r for r in report.rows}
    assert rows["sub"]["calls"] == 1 and rows["sub"]["max_rel"] < 0.05
    assert report.flagged == [] and report.flagged_modules == []
    # configuration restored (the default FP32 list's module patterns beside the class given)
    classes = [t for t in in_force().modules[FP32] if isinstance(t, type)]  # patterns resolve once imported
    assert [c for c in classes if c.__module__ == planted.__name__] == [planted.Recenter]


def test_audit_removes_its_hooks_when_the_step_raises(unsafe_lists):
    model, opt, step, x, y = module_problem()
    hmp.convert(bf16_file_path=unsafe_lists)
    calls = []

    def failing(x, y):
        calls.append(1)
        if len(calls) == 2:  # the fp32 reference passes; under hmp, fc1 raises inside the model's forward
            return step(x[:, :3], y)
        return step(x, y)

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        hmp.audit(failing, x, y, state=(model, opt))
    assert len(calls) == 2
    assert hooks_left(model) == []
    assert in_force().lists[LOWER] >= {"sub"}


def test_write_module_classes_as_import_paths(tmp_path):
    class Local(torch.nn.Module):
        pass

    lists = {"bf16": ["linear", "sub"], "fp32": ["softmax"], "promote": []}
    result = TuneResult(
        lists, lists, None, {}, {"fp32": 1.0}, {}, {"bf16": (), "fp32": (planted.Recenter,)}, strict=True
    )  # written as tune under HMP_STRICT=1 writes them: extending strict's default
    result.write(tmp_path / "b.txt", tmp_path / "f.txt")
    written = (tmp_path / "f.txt").read_text().splitlines()
    assert "include default" in written and written[-1] == "helpers.planted.Recenter"
    assert "-softmax" not in written and "-mse_loss" in written  # only the changes to the default
    hmp.convert(bf16_file_path=tmp_path / "b.txt", fp32_file_path=tmp_path / "f.txt")
    assert in_force().modules[FP32] == (planted.Recenter,)  # the default's patterns taken out, as asked
    assert in_force().lists[LOWER] == {"linear", "sub"} and in_force().lists[FP32] == {"softmax"}

    result.modules = {"bf16": (), "fp32": (planted.Recenter, Local)}
    with pytest.raises(
        ValueError,
        match=r"Local .*'test_tune\.test_write_module_classes_as_import_paths\.<locals>"
        r"\.Local' does not load it",
    ):
        result.write(tmp_path / "b2.txt", tmp_path / "f2.txt")
    assert not (tmp_path / "b2.txt").exists() and not (tmp_path / "f2.txt").exists()


@pytest.mark.slow  # 1.3 s on an idle 2-core CPU, 10-17 s beside another test run
def test_tune_puts_the_unsafe_module_class_in_fp32_not_its_op(unsafe_lists, tmp_path):
    result = tuned(module_problem, unsafe_lists, rounds=1)
    assert result.modules_to_fp32 == [planted.Recenter]
    assert result.moved_to_fp32 == [] and "sub" in result.lists["bf16"]  # the common op stays in bf16
    assert result.proposals["sub"]["own_max_rel"] < 0.05 and result.proposals["sub"]["accepted"]
    assert "module classes to FP32: helpers.planted.Recenter" in result.table()
    v = result.validation
    assert abs(v["tuned lists"] - v["fp32"]) <= 0.02 * v["fp32"]
    assert v["starting lists"] > 1.5 * v["fp32"]

    result.write(tmp_path / "b.txt", tmp_path / "f.txt")
    assert "helpers.planted.Recenter" in (tmp_path / "f.txt").read_text().splitlines()
    hmp.convert(bf16_file_path=tmp_path / "b.txt", fp32_file_path=tmp_path / "f.txt")
    classes = [m for m in in_force().modules[FP32] if isinstance(m, type)]  # with the default's, once imported
    assert [c for c in classes if c.__module__ == planted.__name__] == [planted.Recenter]
    assert "sub" in in_force().lists[LOWER]
    losses = losses_after(module_problem, unsafe_lists, tmp_path / "b.txt", tmp_path / "f.txt")
    assert abs(losses["tuned"] - losses["fp32"]) <= 0.02 * losses["fp32"]
    assert losses["unsafe"] > 1.5 * losses["fp32"]


@hmp.disable_casts()
def diffusion_problem(seed=0):
    """planted.Denoiser learning to predict the noise, timesteps up to 1000."""
    g = torch.Generator().manual_seed(seed)
    x, noise = torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g)
    t = torch.randint(0, 1000, (64,), generator=g)
    torch.manual_seed(seed)
    model = planted.Denoiser()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x, t, noise):
        opt.zero_grad()
        loss = F.mse_loss(model(x, t), noise)
        loss.backward()
        opt.step()
        return loss

    return model, opt, step, (x, t, noise)


def test_audit_names_the_sinusoidal_embedding_as_the_module_making_the_error():
    """No listed op's own error is large (mul: 0.2 %), yet the embedding's
    output is off by 1.7 relative to its scale: sin/cos of the rounded
    product. The error its own code makes names it."""
    model, opt, step, batch = diffusion_problem()
    hmp.convert()
    before = snapshot(model, opt)
    report = hmp.audit(step, *batch, state=(model, opt))
    assert report.flagged == []
    assert {r["op"]: r for r in report.rows}["mul"]["own_max_rel"] < 0.05
    assert report.flagged_modules == ["helpers.planted.TimestepEmbedding"]
    modules = {r["path"]: r for r in report.modules}
    assert modules["embed"]["made_max_rel"] > 0.5
    assert modules["mlp.0"]["made_max_rel"] < 0.05 and modules["mlp.2"]["made_max_rel"] < 0.05
    assert modules[""]["made_max_rel"] < 0.05  # the model's own cat: the error is not the root's own
    lines = report.table().splitlines()
    _, top_module, top_class, largest_seen = [lines[i + 1] for i, line in enumerate(lines) if line.startswith("|---")]
    assert largest_seen.startswith("| helpers.planted.") and report.seen["helpers.planted.TimestepEmbedding"] > 900
    assert top_module.startswith("| embed | helpers.planted.TimestepEmbedding |")
    assert top_class.startswith("| helpers.planted.TimestepEmbedding |") and "error made in it" in top_class
    assert_same_state(before, model, opt)


def test_fp32_entry_for_the_embedding_keeps_timesteps_apart():
    model, opt, step, (x, t, noise) = diffusion_problem()
    ts = torch.tensor([998, 999])
    reference = model.embed(ts)
    with hmp.converted():
        rounded = model.embed(ts)
    assert torch.equal(rounded[0], rounded[1])  # the symptom: two timesteps, one embedding
    hmp.convert(fp32_modules=[planted.TimestepEmbedding])
    assert torch.equal(model.embed(ts), reference)
    report = hmp.audit(step, x, t, noise, state=(model, opt))
    modules = {r["path"]: r for r in report.modules}
    assert modules["embed"]["max_rel"] == 0.0 and report.flagged_modules == []


def test_tune_proposes_the_sinusoidal_embedding_for_fp32(tmp_path):
    model, opt, step, batch = diffusion_problem()
    hmp.convert()
    result = hmp.tune(step, *batch, state=(model, opt), steps=5, rounds=1)
    assert result.modules_to_fp32 == [planted.TimestepEmbedding]
    assert result.moved_to_fp32 == [] and "mul" in result.lists["bf16"]
    assert "getitem" not in result.trials  # t[:, None] only moves values: no candidate for bf16
    proposal = result.module_proposals["helpers.planted.TimestepEmbedding"]
    assert proposal["made_max_rel"] > 0.5 and proposal["accepted"]
    assert proposal["loss_error"] < result.audit.output_error
    assert "module classes to FP32: helpers.planted.TimestepEmbedding" in result.table()
    result.write(tmp_path / "b.txt", tmp_path / "f.txt")
    assert "helpers.planted.TimestepEmbedding" in (tmp_path / "f.txt").read_text().splitlines()


def test_a_list_that_replaced_the_default_is_written_whole_again(tmp_path, monkeypatch):
    """A replacing FP32 file (no 'include default': the user's complete list) that tune leaves as it is is
    written whole again, not as 'include default' and ninety removals whose meaning a later hmp's defaults
    would change; an extending one stays extending. plan() records which lists replaced the default."""
    from hmp.driver.plan import Requested, plan

    monkeypatch.delenv("HMP_STRICT")
    whole = tmp_path / "mine_fp32.txt"
    whole.write_text("cross_entropy\nlog_softmax\nsoftmax\nmse_loss\n")
    extending = tmp_path / "more_fp32.txt"
    extending.write_text("include default\ncumsum\n")
    with pytest.warns(UserWarning, match="replaces the default FP32 list"):  # once per file
        assert plan(Requested(fp32_file_path=whole)).replacing == {FP32}
    assert plan(Requested(fp32_file_path=extending)).replacing == frozenset()
    assert plan(Requested()).replacing == frozenset()
    model, opt, step, x, y = problem()
    hmp.convert(fp32_file_path=whole)
    result = hmp.tune(step, x, y, state=(model, opt), steps=2, rounds=1, min_share=1.0, progress=False)
    assert result.lists["fp32"] == sorted(["cross_entropy", "log_softmax", "softmax", "mse_loss"])  # unchanged
    result.write(tmp_path / "b.txt", tmp_path / "f.txt")
    written = (tmp_path / "f.txt").read_text()
    lines = [line for line in written.splitlines() if line and not line.startswith("#")]
    assert "include default" not in lines and not any(line.startswith("-") for line in lines)
    assert sorted(lines) == result.lists["fp32"] and "replaces the default FP32 list" in written
    from hmp.tools.sentences import files_sentence

    assert "f.txt: the whole list, replacing the default" in files_sentence(result, ("b.txt", "f.txt"))
    hmp.convert(fp32_file_path=tmp_path / "f.txt")
    assert in_force().lists[FP32] == {"cross_entropy", "log_softmax", "softmax", "mse_loss"}
    assert in_force().replacing == {FP32}  # still replacing
    bf16 = [line for line in (tmp_path / "b.txt").read_text().splitlines() if line and not line.startswith("#")]
    assert bf16 == ["include default"]  # the default BF16 list it started from: extending, nothing added
