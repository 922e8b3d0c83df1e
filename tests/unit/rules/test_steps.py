"""Optimizer steps run uncast by themselves while converted (hmp/rules/steps.py)."""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch.optim import optimizer as optim_module

import hmp
from hmp.core import torch_private
from hmp.core.state import tls

BF16 = torch.bfloat16

pytestmark = pytest.mark.usefixtures("one_intra_op_thread", "each_engine")


class Recording(torch.optim.SGD):
    """SGD that records, inside step(), whether casts are on and what a
    BF16-listed op (mm) returns; optionally fails half-way."""

    def __init__(self, params, fail=False, **kw):
        super().__init__(params, lr=0.1, **kw)
        self.fail, self.seen = fail, []

    def step(self, closure=None):
        a = torch.ones(2, 2)
        self.seen.append((hmp.casts_enabled(), torch.mm(a, a).dtype))
        loss = closure() if closure is not None else None
        super().step()
        if self.fail:
            raise ValueError("step failed")
        return loss


@pytest.fixture(params=["python", "autocast"])
def engine(request):
    """Both engines where the step's state decides what a delegated op (mm) does (docs/engines.md)."""
    return request.param


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def test_step_runs_uncast_and_casts_come_back(engine):
    hmp.convert(engine=engine)
    lin = _model()
    opt = Recording(lin.parameters())
    lin(torch.randn(3, 4)).float().sum().backward()
    opt.step()
    assert opt.seen == [(False, torch.float32)]
    assert hmp.casts_enabled() and lin(torch.randn(1, 4)).dtype == BF16


def test_explicit_disable_casts_still_works_and_nests(engine):
    hmp.convert(engine=engine)
    opt = Recording(_model().parameters())
    with hmp.disable_casts():
        opt.step()
        assert not hmp.casts_enabled()  # the user's block is still in force
    assert opt.seen == [(False, torch.float32)] and hmp.casts_enabled()


@pytest.mark.parametrize("inside_disable", [False, True])
def test_exception_inside_step_leaves_casts_as_they_were(inside_disable, engine):
    hmp.convert(engine=engine)
    opt = Recording(_model().parameters(), fail=True)
    if inside_disable:
        with hmp.disable_casts():
            with pytest.raises(ValueError, match="step failed"):
                opt.step()
            assert not hmp.casts_enabled()
    else:
        with pytest.raises(ValueError, match="step failed"):
            opt.step()
    assert opt.seen == [(False, torch.float32)]
    assert hmp.casts_enabled()
    assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == BF16


def test_lbfgs_closure_casts_inside_the_uncast_step(engine):
    hmp.convert(engine=engine)
    lin = _model()
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    opt = torch.optim.LBFGS(lin.parameters(), max_iter=4)
    seen = []

    def closure():
        opt.zero_grad()
        out = lin(x)
        seen.append((hmp.casts_enabled(), out.dtype))
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        return loss

    first = closure().item()
    opt.step(closure)  # keyword-free: the closure positionally
    opt.step(closure=closure)
    assert len(seen) > 3 and set(seen) == {(True, BF16)}
    assert closure().item() < first
    assert all(p.dtype == torch.float32 for p in lin.parameters())
    # a step called inside disable_casts() runs its closure as the caller asked
    seen.clear()
    rec = Recording(lin.parameters())
    with hmp.disable_casts():
        rec.step(closure)
    assert seen == [(False, torch.float32)]


def test_schedulers_param_groups_zero_grad_and_state_stay_fp32():
    hmp.convert()
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(a.parameters(), lr=0.1, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.randn(3, 4)
    for i in range(3):
        if i == 1:
            opt.add_param_group({"params": b.parameters()})
        b(a(x)).float().sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        assert hmp.casts_enabled()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    for state in opt.state.values():
        for v in state.values():
            assert v.dtype == torch.float32
    assert len(opt.state) == 4


def test_step_in_one_thread_leaves_other_threads_casting():
    hmp.convert()
    started, release, seen = threading.Event(), threading.Event(), []

    class Slow(torch.optim.SGD):
        def step(self, closure=None):
            started.set()
            release.wait(10)
            return super().step()

    opt = Slow(_model().parameters(), lr=0.1)
    t = threading.Thread(target=opt.step)
    t.start()
    started.wait(10)
    seen.append(hmp.casts_enabled())
    release.set()
    t.join()
    assert seen == [True]


def test_revert_removes_the_hooks():
    pre = len(optim_module._global_optimizer_pre_hooks)
    post = len(optim_module._global_optimizer_post_hooks)
    record_function = torch.autograd.profiler.record_function
    methods = dict(vars(record_function))
    calls = torch_private.record_function_exit_call()[0].op
    hmp.convert()
    hmp.convert(opt_level="O2")  # re-configuring keeps one set
    assert len(optim_module._global_optimizer_pre_hooks) == pre + 1
    # record_function is left as it is; what its exit operator calls is extended
    assert torch.autograd.profiler.record_function is record_function
    assert dict(vars(record_function)) == methods
    overload, name = torch_private.record_function_exit_call()
    assert vars(overload)[name] is not calls
    hmp.revert()
    assert len(optim_module._global_optimizer_pre_hooks) == pre
    assert len(optim_module._global_optimizer_post_hooks) == post
    assert dict(vars(record_function)) == methods
    assert vars(overload)[name] is calls
    opt = Recording(_model().parameters())
    opt.step()
    assert opt.seen == [(True, torch.float32)]  # nothing patched, nothing disabled


def test_revert_inside_a_step_leaves_casting_on_for_the_next_conversion():
    class Reverting(torch.optim.SGD):
        def step(self, closure=None):
            hmp.revert()
            return super().step()

    hmp.convert()
    Reverting(_model().parameters(), lr=0.1).step()
    hmp.convert()
    assert hmp.casts_enabled() and torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == BF16


# -- a step that raises ----------------------------------------------------------------------


def test_record_function_and_its_exit_operator_stay_torchs_while_converted():
    record_function = torch.autograd.profiler.record_function
    enter, exit_ = record_function.__dict__["__enter__"], record_function.__dict__["__exit__"]
    packet = torch.ops.profiler._record_function_exit
    overload = packet._RecordFunction
    known = {overload}  # as torch's compilers keep it (fx's side-effectful functions, inductor's passes)
    hmp.convert()
    assert record_function.__dict__["__enter__"] is enter and record_function.__dict__["__exit__"] is exit_
    assert torch.autograd.profiler.record_function is record_function
    # the operator objects are the same objects, and still found where torch keeps them
    assert torch.ops.profiler._record_function_exit is packet and packet._RecordFunction is overload
    assert overload in known


def test_a_step_that_raises_and_is_caught_leaves_casts_on_for_the_next_forward():
    hmp.convert()
    lin = _model()
    opt = Recording(lin.parameters(), fail=True)
    lin(torch.randn(3, 4)).float().sum().backward()
    try:
        opt.step()
    except ValueError:
        pass
    assert opt.seen == [(False, torch.float32)]
    assert tls.steps == [] and hmp.casts_enabled()
    assert lin(torch.randn(1, 4)).dtype == BF16  # the next forward casts
    opt.fail = False
    opt.step()  # and the next step runs uncast again
    assert opt.seen[-1] == (False, torch.float32) and hmp.casts_enabled()


def test_a_block_inside_the_step_or_around_it_is_not_the_steps_own():
    hmp.convert()
    seen = []

    class Inner(torch.optim.SGD):
        def step(self, closure=None):
            try:
                with torch.autograd.profiler.record_function("inside the step"):
                    raise KeyError("caught inside the step")
            except KeyError:
                pass
            seen.append(hmp.casts_enabled())  # still the step: uncast
            super().step()
            raise ValueError("step failed")

    opt = Inner(_model().parameters(), lr=0.1)
    with pytest.raises(ValueError):
        with torch.autograd.profiler.record_function("around the step"):
            opt.step()
    assert seen == [False] and tls.steps == [] and hmp.casts_enabled()


def test_a_failed_step_inside_a_step_leaves_only_itself():
    hmp.convert()
    inner = Recording(_model().parameters(), fail=True)
    seen = []

    class Outer(torch.optim.SGD):
        def step(self, closure=None):
            try:
                inner.step()
            except ValueError:
                pass
            seen.append(hmp.casts_enabled())  # the outer step is still open: uncast
            return super().step()

    Outer(_model().parameters(), lr=0.1).step()
    assert inner.seen == [(False, torch.float32)] and seen == [False]
    assert tls.steps == [] and hmp.casts_enabled()


def test_the_profiler_still_records_a_step_that_raises():
    hmp.convert()
    opt = Recording(_model().parameters(), fail=True)
    with torch.autograd.profiler.profile() as prof:
        with pytest.raises(ValueError):
            opt.step()
    # one event, or two once SGD.step itself is hooked (torch hooks a class's step when its first
    # instance is made, and names the event by the instance's class): Recording's super().step()
    assert {e.name for e in prof.function_events if e.name.startswith("Optimizer.step#")} == {
        "Optimizer.step#Recording.step"
    }
    assert hmp.casts_enabled()
