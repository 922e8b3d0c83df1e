"""What hmp never changes (docs/never-changes.md): each departure from the
seed's rule, and the rule itself where no departure applies."""

import copy
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

import hmp
from hmp.driver.queries import in_force

BF16, FP32 = torch.bfloat16, torch.float32

# -- the seed's rule still holds ---------------------------------------------------------------


def _tagged_pointwise(name):
    """Oracle: torch's own tag on the aten overloads of ``name``."""
    packet = getattr(torch.ops.aten, name)
    return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


def _one_pass(name):
    """Oracle: an op that gains nothing from bf16, by torch's own tags
    (pointwise, or random as dropout is)."""
    packet = getattr(torch.ops.aten, name)
    tags = {t for o in packet.overloads() for t in getattr(packet, o).tags}
    return torch.Tag.pointwise in tags or torch.Tag.nondeterministic_seeded in tags


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_listed_ops_on_float32_inputs_run_in_their_lists_dtype(opt_level, strict):
    """The BF16 rule where bf16 pays; a pointwise op follows torch's type
    promotion (float32 given float32) unless strict=True, Habana's literal rule."""
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    with hmp.converted(opt_level=opt_level, strict=strict):
        lists = hmp.effective_lists()
        calls = {
            "mm": lambda: torch.mm(x, w),
            "linear": lambda: F.linear(x, w),
            "matmul": lambda: x @ w,
            "relu": lambda: F.relu(x),
            "mul": lambda: x * w,
            "softmax": lambda: F.softmax(x.bfloat16(), -1),
            "log_softmax": lambda: F.log_softmax(x.bfloat16(), -1),
            "dropout": lambda: F.dropout(x, 0.5),
        }
        for name, call in calls.items():
            kind = "bf16" if name in lists["bf16"] else "fp32" if name in lists["fp32"] else None
            assert kind or (opt_level, strict) == ("O1", False), name  # Habana's lists name them all
            lowered = kind == "bf16" and (strict or not _one_pass(name))
            assert call().dtype == (BF16 if lowered else FP32), (opt_level, name)


# -- no silent overflow ------------------------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True])
def test_float32_minimum_as_a_mask_fill_stays_finite(strict):
    mask = torch.tensor([1.0, 0.0])
    plain = (1.0 - mask) * torch.finfo(torch.float32).min
    with hmp.converted(strict=strict):
        out = (1.0 - mask) * torch.finfo(torch.float32).min
        ordinary = (1.0 - mask) * -1e4
    assert torch.isfinite(out).all() and out.dtype == FP32 and torch.equal(out, plain)
    # an ordinary number: the BF16 rule under strict=True; torch's promotion otherwise
    assert ordinary.dtype == (BF16 if strict else FP32)


def test_a_number_given_by_keyword_is_checked_too():
    a, b, c = torch.zeros(2, 2), torch.full((2, 2), 0.25), torch.full((2, 2), 0.25)
    with hmp.converted():
        big = torch.addmm(a, b, c, alpha=3.4e38)  # beyond bfloat16's largest, not float32's
        small = torch.addmm(a, b, c, alpha=2.0)
    assert big.dtype == FP32 and torch.isfinite(big).all()
    assert small.dtype == BF16


_finite = st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False, width=32)  # FTZ builds


@settings(deadline=None)
@given(
    number=st.one_of(_finite, st.sampled_from([3.3895e38, 3.3896e38, 3.4e38, -3.4e38, 65504.0, 1e39])),
    low=st.sampled_from([torch.bfloat16, torch.float16]),
)
def test_a_bf16_listed_call_never_turns_a_finite_number_inf(number, low):
    """Oracle, from the dtypes' definitions: a number the lower dtype holds as
    a finite value (|x| <= its largest) keeps the BF16 rule; any other finite
    number runs the call in float32, whose result is then what plain torch
    gives. (strict=True: mul is cast there; by default it is torch's own.)"""
    x = torch.tensor([1.0, -0.5])
    low_max = torch.finfo(low).max
    seed = {"fp16_file_path": hmp.list_path("bf16_strict")} if low == torch.float16 else {}  # mul in the lower list
    with hmp.converted(low_precision_type=low, strict=True, **seed):
        out = torch.mul(x, number)
    if abs(number) <= low_max:
        assert out.dtype == low
    else:
        assert out.dtype == FP32 and torch.equal(out, x * number)


# -- views stay views --------------------------------------------------------------------------


def test_writes_through_a_view_of_a_listed_view_op_reach_the_tensor():
    a = torch.zeros(2, 3)
    lin = nn.Linear(3, 2)
    with hmp.converted():
        early = a.t()
        a.t()[0] = 1.0
        with torch.no_grad():
            lin.weight.t().copy_(torch.ones(3, 2))  # an (in, out) checkpoint loaded through a transpose
        a[1, 2] = 5.0
        assert early._base is a and early.dtype == FP32
    assert a[:, 0].tolist() == [1.0, 1.0] and early[2, 1].item() == 5.0
    assert torch.equal(lin.weight, torch.ones(2, 3))


def test_the_seeds_t_binds_nothing_and_views_stay_views(tmp_path):
    path = tmp_path / "bf16.txt"
    path.write_text("t\nmm\n")  # Habana's published lists name t
    x = torch.randn(4, 4)
    with hmp.converted(bf16_file_path=path):
        views = [x.view(16), x.reshape(2, 8), x.transpose(0, 1), x.narrow(0, 1, 2), x.t()]
        assert torch.mm(x, x).dtype == BF16
    assert all(v._base is x and v.dtype == FP32 for v in views)


def test_views_inside_a_bf16_module_stay_views():
    class Writer(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("state", torch.zeros(2, 3))

        def forward(self, x):
            self.state.t()[0] += 1.0  # in place through a view of a float32 buffer
            self.state[1][2] = 7.0  # and through indexing
            return x @ self.state.t()

    m = Writer()
    with hmp.converted(bf16_modules=[Writer]):
        out = m(torch.ones(1, 3))
    assert out.dtype == BF16 and m.state.dtype == FP32
    assert m.state[:, 0].tolist() == [1.0, 1.0] and m.state[1, 2].item() == 7.0


# -- weight averaging is a weight update -------------------------------------------------------


def _average(make, update, convert, steps):
    """An average of a Linear's weight, made at 0 and updated ``steps`` times
    towards 1, with hmp converted or not; the averaged weight."""
    torch.manual_seed(0)
    net = nn.Linear(4, 4)
    with torch.no_grad():
        net.weight.zero_()
    average = make(net)
    with torch.no_grad():
        net.weight.fill_(1.0)
    if convert:
        hmp.convert()
    try:
        for _ in range(steps):
            update(average, net)
    finally:
        hmp.revert()
    return (average.module if hasattr(average, "module") else average.ema).weight  # timm's ModelEma: .ema


def _averaged_model(net, **fn):
    model = AveragedModel(net, **fn)
    model.update_parameters(net)  # the first update copies
    return model


@pytest.mark.parametrize(
    "fn",
    [{"avg_fn": get_ema_avg_fn(0.999)}, {"multi_avg_fn": get_ema_multi_avg_fn(0.999)}, {}],
    ids=["avg_fn", "multi_avg_fn", "swa"],
)
def test_averaged_model_matches_plain_torch(fn):
    plain, mixed = (
        _average(lambda net: _averaged_model(net, **fn), lambda avg, net: avg.update_parameters(net), convert, 2000)
        for convert in (False, True)
    )
    assert mixed.dtype == FP32
    torch.testing.assert_close(mixed, plain, atol=1e-3, rtol=0)
    assert plain[0, 0].item() > 0.8  # moved well away from where bf16 would stall (0.5)


def test_timm_ema_helpers_match_plain_torch():
    pytest.importorskip("timm", reason="timm is installed on CI's newest-torch leg (with torchvision)")
    from timm.utils import model_ema

    for name in ("ModelEma", "ModelEmaV2", "ModelEmaV3"):
        cls = getattr(model_ema, name, None)
        if cls is None:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # ModelEma is deprecated in timm
            plain, mixed = (
                _average(lambda net, cls=cls: cls(net, decay=0.999), lambda ema, net: ema.update(net), convert, 500)
                for convert in (False, True)
            )
        torch.testing.assert_close(mixed, plain, atol=1e-3, rtol=0, msg=name)


def test_lightning_swa_update_is_exact():
    """Oracle: plain torch. Weight averaging is pointwise: never pulled down."""
    callbacks = pytest.importorskip("lightning.pytorch.callbacks")
    swa = callbacks.StochasticWeightAveraging
    net, avg = nn.Linear(4, 4), nn.Linear(4, 4)
    seen = []
    n = torch.tensor(1)

    def avg_fn(averaged, current, count):
        seen.append(averaged + (current - averaged) / (count + 1))
        return seen[-1]

    plain = copy.deepcopy(avg)
    swa.update_parameters(plain, net, n.clone(), avg_fn)  # it counts in place
    with hmp.converted():
        swa.update_parameters(avg, net, n, avg_fn)
    for p, q in zip(avg.parameters(), plain.parameters()):
        assert p.dtype == FP32 and torch.equal(p, q)


@settings(deadline=None)
@given(factor=st.floats(0.5, 1.5), low=st.sampled_from([torch.bfloat16, torch.float16]))
def test_a_product_with_float32_data_runs_as_plain_torch_runs_it(factor, low):
    """Oracle: plain torch, outside hmp. A multiplication (pointwise, by
    torch's tag) never pulls float32 data down, whatever the factor: the
    result is bit for bit plain torch's; on lower-precision data it runs in
    that dtype, as torch's promotion gives. strict=True casts it."""
    ema = torch.randn(4)
    plain = (ema * factor, factor * ema, ema * torch.tensor(factor), ema.to(low) * factor)
    seed = {"fp16_file_path": hmp.list_path("bf16_strict")} if low == torch.float16 else {}
    with hmp.converted(low_precision_type=low, **seed):
        got = (ema * factor, factor * ema, ema * torch.tensor(factor), ema.to(low) * factor)
        keyword = torch.mul(ema, other=factor)
    for out, expected in zip(got, plain):
        assert out.dtype == expected.dtype and torch.equal(out, expected)
    assert torch.equal(keyword, plain[0])
    with hmp.converted(low_precision_type=low, strict=True, **seed):
        assert (ema * factor).dtype == low


@pytest.mark.parametrize("tau", [0.001, 0.005, 0.05, torch.tensor(0.005)])
@pytest.mark.parametrize("form", ["state_dict", "data.copy_", "data =", "in place", "lerp"])
def test_hand_written_soft_updates_follow_the_source(form, tau):
    steps = 300
    torch.manual_seed(0)
    source, target = nn.Linear(16, 4), nn.Linear(16, 4)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.05 * torch.randn_like(p))

    def gap():
        return sum((a - b).abs().sum() for a, b in zip(source.parameters(), target.parameters())).item()

    start = gap()
    with hmp.converted():
        for _ in range(steps):
            if form == "state_dict":
                t, s = target.state_dict(), source.state_dict()
                target.load_state_dict({k: s[k] * tau + t[k] * (1 - tau) for k in s})
            elif form == "data.copy_":
                for p, q in zip(target.parameters(), source.parameters()):
                    p.data.copy_(tau * q.data + (1 - tau) * p.data)
            elif form == "data =":
                for p, q in zip(target.parameters(), source.parameters()):
                    p.data = (1 - tau) * p.data + tau * q.data
            elif form == "lerp":
                with torch.no_grad():
                    for p, q in zip(target.parameters(), source.parameters()):
                        p.copy_(torch.lerp(p, q, tau))
            else:
                with torch.no_grad():
                    for p, q in zip(target.parameters(), source.parameters()):
                        p.mul_(1 - tau).add_(q * tau)
    left, exact = gap() / start, (1 - float(tau)) ** steps
    assert all(p.dtype == FP32 for p in target.parameters())
    # the floor: tau * source rounds to bfloat16 (2**-9 of the source), where the target settles
    assert abs(left - exact) <= 0.1 * exact + 4e-3, (left, exact)


@pytest.mark.parametrize("form", ["1.0 * p", "p * 1 + t * 0"])
def test_a_hard_target_update_copies_exactly(form):
    """CleanRL's DQN default (tau = 1.0): the target becomes the source, bit for bit."""
    source, target = torch.randn(64), torch.zeros(64)
    with hmp.converted():
        target.copy_(1.0 * source + (1.0 - 1.0) * target if form == "1.0 * p" else source * 1 + target * 0)
    assert torch.equal(target, source)


def test_rounded_values_loaded_into_float32_weights_are_said_once():
    """A soft update hmp cannot see as one (no decay-like factor) writes
    bfloat16 values through load_state_dict: said once, at the user's line;
    not under disable_casts() and not for float32 values."""
    source, target = nn.Linear(4, 2), nn.Linear(4, 2)
    hmp.core.state.warned.discard(("rounded into fp32", BF16))
    with hmp.converted(strict=True):  # bfloat16 products: Habana's rule casts pointwise ops
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            target.load_state_dict(source.state_dict())  # float32 values: nothing to say
            with hmp.disable_casts():
                target.load_state_dict({k: v * 0.5 + v * 0.5 for k, v in source.state_dict().items()})
        with pytest.warns(UserWarning, match=r"load_state_dict\(\) writes bfloat16 values into float32") as record:
            for _ in range(2):
                t, s = target.state_dict(), source.state_dict()
                target.load_state_dict({k: s[k] * 0.3 + t[k] * 0.7 for k in s})
    assert sum("load_state_dict" in str(w.message) for w in record) == 1
    assert record[0].filename == __file__ and "'weight'" in str(record[0].message)
    assert all(p.dtype == FP32 for p in target.parameters())


def test_in_place_updates_are_exact():
    ema, p = torch.zeros(4), torch.ones(4)
    with hmp.converted():
        exact = ema.clone()
        for _ in range(10):
            exact.lerp_(p, 0.001)  # in place: the dtype of what it writes
    assert exact.dtype == FP32 and torch.allclose(exact, torch.full((4,), 1 - 0.999**10))


# -- buffers keep their dtype ------------------------------------------------------------------


class RunningMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.mean = 0.5 * self.mean + 0.5 * x.mean(0)  # no decay-like factor: both products in bfloat16
        self.steps = self.steps + 1
        return x - self.mean


def test_a_buffer_reassigned_while_converted_keeps_its_dtype():
    m = RunningMean()
    with hmp.converted(strict=True):  # bfloat16 products: Habana's rule casts pointwise ops
        with pytest.warns(UserWarning, match="buffer 'mean' of RunningMean"):
            m(torch.ones(3, 4))
        m(torch.ones(3, 4))
    state = m.state_dict()
    assert state["mean"].dtype == FP32 and state["steps"].dtype == torch.long and state["steps"].item() == 2
    m.mean = m.mean.bfloat16()  # not converted: the author's choice
    assert m.mean.dtype == BF16


# -- custom autograd Functions -----------------------------------------------------------------


def _mm_function(cast_inputs, doc):
    """torch's "Extending autograd" example (a matmul) made AMP-safe with
    custom_fwd/custom_bwd; its backward records whether hmp casts there."""

    class MM(torch.autograd.Function):
        __doc__ = doc

        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu", cast_inputs=cast_inputs)
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a.mm(b)

        @staticmethod
        @torch.amp.custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            seen.append(hmp.casts_enabled())
            return grad.mm(b.t()), a.t().mm(grad)

    return MM


MyMM = _mm_function(torch.float32, "cast_inputs=float32: the whole Function in float32")
FollowsForward = _mm_function(None, "custom_fwd without cast_inputs: the backward runs as its forward did")

seen = []


def _grads(fn, convert):
    torch.manual_seed(0)
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    if convert:
        hmp.convert()
    try:
        out = fn.apply(torch.mm(a, torch.eye(4)) if convert else a, b)  # a bf16 input, as after a listed op
        out.float().sum().backward()
    finally:
        hmp.revert()
    return out, a.grad, b.grad


def test_custom_fwd_cast_inputs_runs_the_function_in_that_dtype():
    plain, mixed = _grads(MyMM, False), _grads(MyMM, True)
    assert mixed[0].dtype == FP32
    torch.testing.assert_close(mixed[2], plain[2], atol=0.05, rtol=0.02)  # the input itself came through bf16
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, 2, requires_grad=True)
    ref = MyMM.apply(a, b)
    ref.sum().backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    with hmp.converted():
        out = MyMM.apply(a, b)
        out.sum().backward()
    assert torch.equal(out, ref) and torch.equal(a.grad, ga) and torch.equal(b.grad, gb)


def test_custom_bwd_without_cast_inputs_runs_backward_as_its_forward_ran():
    seen.clear()
    out, ga, gb = _grads(FollowsForward, True)
    assert out.dtype == BF16 and seen == [True]
    assert ga.dtype == gb.dtype == FP32
    with hmp.converted(), hmp.disable_casts():
        x = torch.randn(2, 2, requires_grad=True)
        FollowsForward.apply(x, x).sum().backward()
    assert seen == [True, False]


def test_a_mismatch_in_a_hand_written_backward_is_noted_as_backward():
    class Plain(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a.mm(b)

        @staticmethod
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            return grad.mm(b.t()), a.t().mm(grad)

    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    with hmp.converted():
        with pytest.raises(RuntimeError) as info:
            Plain.apply(a, b).float().sum().backward()
    note = " ".join(getattr(info.value, "__notes__", []))
    assert "in a backward pass" in note and "custom_fwd" in note and "disable_casts" not in note


# -- threads and fake tensors ------------------------------------------------------------------


def test_converted_blocks_in_two_threads_leave_nothing_converted():
    a_in, b_in, a_out, b_out = (threading.Event() for _ in range(4))
    levels = []

    def thread_a():
        with hmp.converted(opt_level="O1"):
            a_in.set()
            a_out.wait()

    def thread_b():
        a_in.wait()
        with hmp.converted(opt_level="O2"):
            b_in.set()
            b_out.wait()

    ta, tb = threading.Thread(target=thread_a), threading.Thread(target=thread_b)
    ta.start()
    tb.start()
    b_in.wait()
    levels.append(in_force().options.opt_level)
    a_out.set()
    ta.join()
    levels.append(in_force().options.opt_level)  # B's block is still open: its configuration stays
    b_out.set()
    tb.join()
    assert levels == ["O2", "O2"]
    assert not hmp.is_converted() and torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == FP32


def test_nested_blocks_in_one_thread_restore_in_order():
    with hmp.converted(opt_level="O1"):
        with hmp.converted(opt_level="O2"):
            assert in_force().options.opt_level == "O2"
        assert in_force().options.opt_level == "O1"
    assert not hmp.is_converted()


def test_parameters_under_fake_tensor_mode_raise_no_data_pointer_warning():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        lin = nn.Linear(4, 4)
        x = torch.randn(2, 4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with hmp.converted():
                out = lin(x)
    assert out.dtype == BF16
