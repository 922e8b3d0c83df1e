"""engine="autocast" (docs/engines.md): torch.autocast's dispatcher casts the
ops where hmp's lists agree with autocast's policy, hmp's wrappers the rest;
results bit-equal to engine="python" wherever the docs name no difference."""

import os
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import profiled
from helpers.models import ConvAttention
from torch.utils.checkpoint import checkpoint

import hmp
from hmp.binding import autocast_policy
from hmp.binding import engine as engine_plan
from hmp.binding.kinds import LOWER
from hmp.binding.resolve import Resolver
from hmp.core.dtypes import BF16, FP32, FP64

ENGINES = ("python", "autocast")
HMP_DIR = os.path.dirname(os.path.abspath(hmp.__file__))


def autocast_state():
    return (
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_cache_enabled(),
    )


def run(engine, recompute=False, compile_backend=None):
    torch.manual_seed(0)
    model, x = ConvAttention(), torch.randn(2, 5, 16)
    with hmp.converted(engine=engine):
        fn = model if compile_backend is None else torch.compile(model, backend=compile_backend)
        out = fn(x, recompute)
        out.backward()
        mids = (model.up(x).dtype, torch.mv(x[0], model.v).dtype)
    return out.detach(), [p.grad for p in model.parameters()], mids


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "checkpoint"])
def test_forward_and_gradients_are_bit_equal_between_engines(recompute):
    out_p, grads_p, mids_p = run("python", recompute)
    out_a, grads_a, mids_a = run("autocast", recompute)
    assert mids_p == mids_a == (torch.bfloat16, torch.bfloat16)
    assert torch.equal(out_p, out_a)
    assert all(g.dtype == torch.float32 for g in grads_a)
    assert all(torch.equal(p, a) for p, a in zip(grads_p, grads_a))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_equals_eager(backend, fresh_dynamo):
    out_e, grads_e, _ = run("autocast")
    out_c, grads_c, _ = run("autocast", compile_backend=backend)
    assert torch.equal(out_e, out_c)
    assert all(torch.equal(e, c) for e, c in zip(grads_e, grads_c))


def test_delegated_ops_have_no_wrapper_and_detail_names_the_engine():
    """mse_loss (FP32 list): autocast casts it as hmp would for every dtype mix, so it is left to
    autocast; linear is not (autocast would cast a float16 input to bfloat16, hmp keeps it), nor mv
    (CPU autocast has no kernel for it); cat is hmp's to leave to torch, and autocast, which would
    raise on float16, is off around it."""
    original = torch._C._nn.mse_loss
    hmp.convert(engine="autocast")
    assert torch._C._nn.mse_loss is original and F.linear.__module__ != "torch.nn.functional"
    detail = hmp.effective_lists(detail=True)
    assert detail["fp32"]["mse_loss"] == engine_plan.DELEGATED
    assert detail["bf16"]["linear"] == detail["bf16"]["mv"] == engine_plan.WRAPPED
    assert detail["promote"]["cat"].endswith(engine_plan.OFF)
    x = torch.randn(3, dtype=torch.bfloat16)
    assert F.mse_loss(x, x).dtype == torch.float32
    assert F.linear(torch.randn(2, 3), torch.randn(4, 3)).dtype == torch.bfloat16
    assert torch.mv(torch.randn(2, 3), torch.randn(3)).dtype == torch.bfloat16
    assert torch.cat([torch.ones(2, dtype=torch.float16)] * 2).dtype == torch.float16


def test_no_hmp_frame_runs_in_a_delegated_call():
    x, y = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8, requires_grad=True)
    seen = []

    def profile(frame, event, arg):
        if event == "call" and os.path.abspath(frame.f_code.co_filename).startswith(HMP_DIR):
            seen.append(frame.f_code.co_name)

    hmp.convert(engine="autocast")
    F.mse_loss(x, y)  # first call: nothing lazy left
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            with profiled(profile):
                out = F.mse_loss(x, y)
        assert out.dtype == torch.float32
    assert seen == []


def test_every_switch_of_hmp_turns_autocast_off():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    hmp.convert(engine="autocast")
    assert torch.is_autocast_enabled("cpu") and torch.is_autocast_cache_enabled()
    with hmp.disable_casts():
        assert not torch.is_autocast_enabled("cpu")
        assert F.linear(x, w).dtype == torch.float32
        with hmp.enable_casts():
            assert F.linear(x, w).dtype == torch.bfloat16
    assert torch.is_autocast_enabled("cpu")

    seen = []
    p = nn.Parameter(torch.randn(3))

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(("step", torch.is_autocast_enabled("cpu")))
            return super().step(closure)

    y = (p * 2).sum()
    y.register_hook(lambda g: seen.append(("backward", torch.is_autocast_enabled("cpu"))))
    y.backward()
    Recording([p], lr=0.1).step()
    assert seen == [("backward", False), ("step", False)]
    assert torch.is_autocast_enabled("cpu")


def test_fp32_module_entry_turns_autocast_off():
    lin = nn.Linear(8, 8)
    outer = nn.Sequential(lin)
    hmp.convert(engine="autocast", fp32_modules=[outer])
    assert outer(torch.randn(2, 8)).dtype == torch.float32
    assert lin(torch.randn(2, 8)).dtype == torch.bfloat16


@pytest.mark.parametrize("before", [(False, torch.float16, True), (True, torch.bfloat16, True)])
def test_revert_puts_the_threads_autocast_state_back(before):
    found = autocast_state()
    torch.set_autocast_enabled("cpu", before[0])
    torch.set_autocast_dtype("cpu", before[1])
    torch.set_autocast_cache_enabled(before[2])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hmp.convert(engine="autocast")
            assert autocast_state() == (True, torch.bfloat16, True)
            hmp.convert(engine="autocast")  # again: what the thread had before the first stays kept
            hmp.revert()
        assert autocast_state() == before
    finally:
        torch.set_autocast_enabled("cpu", found[0])
        torch.set_autocast_dtype("cpu", found[1])
        torch.set_autocast_cache_enabled(found[2])


def test_a_failed_convert_changes_nothing(pristine):
    found = autocast_state()
    with pytest.raises(ValueError, match="engine must be one of"):
        hmp.convert(engine="dispatcher")
    with pytest.raises(ValueError, match="bfloat16 only"):
        hmp.convert(engine="autocast", low_precision_type=torch.float16)
    assert autocast_state() == found


def test_hmp_engine_in_the_environment_chooses_for_an_unchanged_script(monkeypatch, pristine):
    """engine=None (the default) reads HMP_ENGINE, as strict=None reads HMP_STRICT; a value it does
    not know is an error naming the variable, and changes nothing."""
    monkeypatch.setenv("HMP_ENGINE", "autocast")
    hmp.convert()
    try:
        assert hmp.effective_lists(detail=True) != {} and torch.is_autocast_enabled("cpu")
        assert F.linear(torch.randn(2, 4), torch.randn(3, 4)).dtype == torch.bfloat16
    finally:
        hmp.revert()
    monkeypatch.setenv("HMP_ENGINE", "python")
    hmp.convert()
    try:
        assert not torch.is_autocast_enabled("cpu")
    finally:
        hmp.revert()
    monkeypatch.setenv("HMP_ENGINE", "autocast")  # a float16 script keeps the Python engine, and is told
    with pytest.warns(UserWarning, match="HMP_ENGINE=autocast runs bfloat16 on CPU and CUDA only"):
        hmp.convert(low_precision_type=torch.float16)
    try:
        assert not torch.is_autocast_enabled("cpu")
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float16
    finally:
        hmp.revert()
    found = autocast_state()
    monkeypatch.setenv("HMP_ENGINE", "dispatcher")
    with pytest.raises(ValueError, match="HMP_ENGINE must be one of python, autocast, got 'dispatcher'"):
        hmp.convert()
    assert not hmp.is_converted() and autocast_state() == found


def test_a_users_own_autocast_region_runs_stock_autocast():
    """Inside the author's region: autocast's own lists (conv_tbc cast, mv not),
    as without hmp; outside it: hmp's lists (conv_tbc not cast, mv cast)."""
    x, w, b = torch.randn(3, 1, 2), torch.randn(1, 2, 2), torch.randn(2)
    m, v = torch.randn(2, 3), torch.randn(3)

    def dtypes():
        return torch.conv_tbc(x, w, b).dtype, torch.mv(m, v).dtype

    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock = dtypes()
    assert stock == (torch.bfloat16, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hmp.convert(engine="autocast")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert dtypes() == stock
        assert dtypes() == (torch.float32, torch.bfloat16)
        assert autocast_state() == (True, torch.bfloat16, True)


def _in_thread(fn, start_gate=None):
    result = []

    def body():
        if start_gate is not None:
            start_gate.wait()
        result.append(fn())

    return threading.Thread(target=body), result


def test_threads_started_while_converted_join_and_earlier_ones_do_not():
    x, m, v = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(2, 3), torch.randn(3)

    def dtypes():  # (l1_loss: torch 2.4's CPU mse_loss has no bfloat16 kernel)
        return F.l1_loss(x, x).dtype, torch.mv(m, v).dtype, torch.is_autocast_enabled("cpu")

    gate = threading.Event()
    earlier, earlier_result = _in_thread(dtypes, gate)
    earlier.start()
    hmp.convert(engine="autocast")
    later, later_result = _in_thread(dtypes)
    later.start()
    later.join()
    gate.set()
    earlier.join()
    assert later_result == [(torch.float32, torch.bfloat16, True)]
    # a thread running before convert() has its own autocast state: hmp's wrappers cast there, autocast does not
    assert earlier_result == [(torch.bfloat16, torch.bfloat16, False)]


def test_a_thread_started_while_converted_gets_its_state_back_at_its_next_switch():
    go, done = threading.Event(), threading.Event()
    seen = []

    def body():
        seen.append(torch.is_autocast_enabled("cpu"))
        go.wait()
        seen.append(torch.is_autocast_enabled("cpu"))  # reverted in another thread: not yet back
        with hmp.disable_casts():
            pass
        seen.append(torch.is_autocast_enabled("cpu"))
        done.set()

    hmp.convert(engine="autocast")
    t = threading.Thread(target=body)
    t.start()
    hmp.revert()
    go.set()
    t.join()
    assert seen == [True, True, False]


def test_the_difference_docs_engines_md_names():
    """Pinned so the docs change with it: a bfloat16 leaf used by several delegated calls of one
    forward is cast at each by autocast, once by hmp's weight cache, so its gradient is summed in
    bfloat16 under the engine and in float32 under engine="python"; the forward is bit-equal."""
    torch.manual_seed(0)
    w0, t = torch.randn(64, dtype=torch.bfloat16), torch.randn(64)
    found = {}
    for engine in ENGINES:
        w = nn.Parameter(w0.clone())
        with hmp.converted(engine=engine):
            loss = F.mse_loss(w, t) + F.l1_loss(w, 2 * t) + F.mse_loss(w, 3 * t)
            loss.backward()
        found[engine] = loss.detach(), w.grad
    assert torch.equal(found["python"][0], found["autocast"][0])
    grads = [g.float() for _, g in found.values()]
    assert not torch.equal(*grads)
    assert torch.allclose(*grads, rtol=2**-7, atol=0)  # within a bfloat16 rounding of the sum


def test_an_op_removed_from_its_list_runs_as_torchs_on_both_engines(tmp_path):
    """addmm removed from the BF16 list keeps a wrapper for the calls that need one dtype; a
    float32 call needs none and runs as torch's: autocast, which would cast it, is off there."""
    no_addmm = tmp_path / "bf16.txt"
    no_addmm.write_text("include default\n-addmm\n")
    a, b, c = torch.randn(2, 3), torch.randn(2, 4), torch.randn(4, 3)
    found = {}
    for engine in ENGINES:
        with hmp.converted(engine=engine, bf16_file_path=no_addmm):
            found[engine] = torch.addmm(a, b, c)
    assert found["python"].dtype == found["autocast"].dtype == torch.float32
    assert torch.equal(found["python"], found["autocast"])


def test_what_were_differences_are_equal(tmp_path):
    """The saturating cast holds on both engines (no op that casts down is delegated: autocast
    would cast a float16 input too), and a composite in no list whose kernels call ops autocast
    casts (nn.LSTM with lstm removed from the BF16 list) runs as torch's on both."""
    x, w = torch.tensor([[3.4e38, 1.0]]), torch.ones(1, 2)
    lstm, seq = nn.LSTM(4, 4), torch.randn(2, 1, 4)
    no_lstm = tmp_path / "bf16.txt"
    no_lstm.write_text("include default\n-lstm\n")
    found = {}
    for engine in ENGINES:
        with hmp.converted(engine=engine):
            found[engine] = [bool(torch.isfinite(F.linear(x, w)).all())]
        with hmp.converted(engine=engine, bf16_file_path=no_lstm):
            out = lstm(seq)[0]
            found[engine] += [out.dtype, out]
    assert found["python"][:2] == found["autocast"][:2] == [True, torch.float32]
    assert torch.equal(found["python"][2], found["autocast"][2])


def test_no_op_that_casts_down_is_delegated_even_where_every_mix_agrees(monkeypatch, pristine):
    """On a torch whose autocast kept float16 (the probe's mixes float32, bfloat16 and float64 only),
    linear would agree on every mix: it still keeps hmp's wrapper, whose cast saturates where
    autocast's gives inf (a value no probe tries). The FP32 list's losses are delegated as before."""
    monkeypatch.setattr(autocast_policy, "MIXED", (FP32, BF16, FP64))
    monkeypatch.setattr(autocast_policy, "_agreed", {})
    agrees = autocast_policy.in_clean_thread(
        lambda: autocast_policy.agrees(Resolver(), LOWER, "linear", "cpu", BF16, False, True)
    )
    assert agrees  # the premise: on these mixes autocast gives what hmp's wrapper gives
    with hmp.converted(engine="autocast"):
        detail = hmp.effective_lists(detail=True)
        assert detail["bf16"]["linear"] == engine_plan.WRAPPED
        assert engine_plan.DELEGATED not in detail["bf16"].values()
        assert detail["fp32"]["mse_loss"] == engine_plan.DELEGATED
        x, w = torch.tensor([[3.4e38, 1.0]]), torch.ones(1, 2)
        assert torch.isfinite(F.linear(x, w)).all()


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_recompute_with_a_wrapped_op_matches_and_says_nothing(reentrant):
    """torch's checkpoint re-enters its forward's autocast state to recompute: hmp's wrapped op
    (mv) still casts inside it, and no warning about an author's region is given."""
    torch.manual_seed(0)
    w, v, x = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4)), torch.randn(3, 4, requires_grad=True)
    found = {}
    for engine in ENGINES:
        with hmp.converted(engine=engine), warnings.catch_warnings():
            warnings.filterwarnings("error", message="hmp:")  # torch 2.4's checkpoint warns of itself
            y = checkpoint(lambda t: torch.mv(F.linear(t, w), v), x, use_reentrant=reentrant)
            y.float().sum().backward()
        found[engine] = (y.detach(), w.grad, v.grad)
        w.grad = v.grad = None
    assert all(torch.equal(p, a) for p, a in zip(found["python"], found["autocast"]))
