"""convert/revert/disable_casts behaviour: undo, threads, nesting, errors,
normalization, in-place calls, autograd, O2, fp16, verbose and op_wrap."""

import logging
import threading

import pytest
import torch
import torch.nn.functional as F

import hmp
from helpers import assert_same, snapshot, write

BF16, FP32 = torch.bfloat16, torch.float32


# -- undo -------------------------------------------------------------------------


def test_revert_restores_namespaces_exactly(pristine):
    hmp.convert()
    assert "mul" in vars(torch.Tensor)  # inherited from TensorBase, set on Tensor
    hmp.revert()
    assert "mul" not in vars(torch.Tensor)  # deleted, not re-set
    assert_same(pristine, snapshot())


def test_revert_without_convert_is_noop(pristine):
    hmp.revert()
    hmp.revert()
    assert_same(pristine, snapshot())


def test_convert_twice_reconfigures_and_never_wraps_a_wrapper(tmp_path, pristine):
    hmp.convert()
    first = F.linear
    hmp.convert(bf16_file_path=write(tmp_path, "b.txt", "linear\n"))
    assert F.linear is not first
    assert F.linear.__hmp_original__ is pristine["torch.nn.functional"]["linear"]
    assert torch.Tensor.relu is torch._C.TensorBase.relu  # no longer listed
    hmp.convert(opt_level="O2")
    hmp.revert()
    assert_same(pristine, snapshot())


def test_failed_convert_patches_nothing(tmp_path, pristine):
    with pytest.raises(ValueError):
        hmp.convert(bf16_file_path=write(tmp_path, "b.txt", "linear\nnot_an_op_at_all\n"))
    assert_same(pristine, snapshot())
    assert not hmp.is_converted()


# -- the HMP tutorial script ----------------------------------------------------------


def test_tutorial_script_trains_in_bf16(device):
    torch.manual_seed(0)
    hmp.convert(opt_level="O1", bf16_file_path="", fp32_file_path="", isVerbose=False)
    N, D_in, D_out = 64, 256, 32
    x = torch.randn(N, D_in, device=device)
    y = torch.randn(N, D_in, device=device) @ torch.randn(D_in, D_out, device=device) / 16
    model = torch.nn.Linear(D_in, D_out).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(60):
        y_pred = model(x)
        assert y_pred.dtype == BF16
        loss = F.mse_loss(y_pred, y)
        optimizer.zero_grad()
        loss.backward()
        with hmp.disable_casts():
            optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]
    for p in model.parameters():
        assert p.dtype == FP32 and p.grad.dtype == FP32


# -- disable_casts ----------------------------------------------------------------------


def test_disable_casts_nesting_and_decorator():
    hmp.convert()
    x = torch.randn(2, 2)
    with hmp.disable_casts():
        with hmp.disable_casts():
            assert not hmp.casts_enabled()
        assert not hmp.casts_enabled()  # the outer block is still disabled
        assert torch.mm(x, x).dtype == FP32
    assert hmp.casts_enabled() and torch.mm(x, x).dtype == BF16

    @hmp.disable_casts()
    def step():
        return torch.mm(x, x).dtype

    assert step() == FP32 and torch.mm(x, x).dtype == BF16


def test_disable_casts_exception_safe():
    hmp.convert()
    with pytest.raises(KeyError):
        with hmp.disable_casts():
            raise KeyError("boom")
    assert hmp.casts_enabled()
    assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == BF16


def test_exception_inside_wrapped_op_leaves_state_correct():
    hmp.convert()
    with pytest.raises(RuntimeError):
        torch.mm(torch.ones(2, 3), torch.ones(2, 3))  # shape mismatch inside the op
    assert hmp.casts_enabled()
    assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == BF16


def test_disable_casts_is_thread_local():
    hmp.convert()
    x = torch.ones(4, 4)
    entered, checked = threading.Event(), threading.Event()
    seen = {}

    def other():
        entered.wait(10)
        seen["enabled"] = hmp.casts_enabled()
        seen["dtype"] = torch.mm(x, x).dtype
        checked.set()

    t = threading.Thread(target=other)
    t.start()
    with hmp.disable_casts():
        entered.set()
        checked.wait(10)
        assert torch.mm(x, x).dtype == FP32
    t.join(10)
    assert seen == {"enabled": True, "dtype": BF16}


def test_enable_casts_inside_disable_casts():
    hmp.convert()
    x = torch.ones(2, 2)
    with hmp.disable_casts():
        with hmp.disable_casts():
            with hmp.enable_casts():
                assert hmp.casts_enabled() and torch.mm(x, x).dtype == BF16
                with hmp.disable_casts():  # nests either way
                    assert torch.mm(x, x).dtype == FP32
                assert torch.mm(x, x).dtype == BF16
            assert not hmp.casts_enabled()
        with pytest.raises(KeyError):
            with hmp.enable_casts():
                raise KeyError("boom")
        assert not hmp.casts_enabled()  # restored on the exception path too
    assert hmp.casts_enabled()


def test_enable_casts_as_a_decorator_in_two_threads():
    """Each call gets its own block: threads never share one saved state."""
    hmp.convert()
    x = torch.ones(2, 2)
    inside, release = threading.Barrier(2), threading.Event()

    @hmp.enable_casts()
    def step():
        inside.wait(10)
        release.wait(10)
        return torch.mm(x, x).dtype

    out = []

    def worker():
        with hmp.disable_casts():
            out.append((step(), hmp.casts_enabled()))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join(10)
    assert out == [(BF16, False), (BF16, False)]
    block = hmp.enable_casts()
    with block, pytest.raises(RuntimeError, match="already in use"):
        with block:
            pass


def test_converted_restores_what_was_in_force(tmp_path, pristine):
    x = torch.ones(2, 2)
    with hmp.converted():
        assert torch.mm(x, x).dtype == BF16
        with hmp.converted(fp32_file_path=write(tmp_path, "f.txt", "mm\n")):
            assert torch.mm(x, x).dtype == FP32
        assert torch.mm(x, x).dtype == BF16 and hmp.effective_lists()["fp32"] != ["mm"]
        with pytest.raises(KeyError):
            with hmp.converted(opt_level="O2"):
                raise KeyError("boom")
        assert "linear" in hmp.effective_lists()["bf16"] and hmp.effective_lists()["fp32"] != []
        with pytest.raises(ValueError, match="not_an_op"):  # a bad list: nothing changes
            with hmp.converted(bf16_file_path=write(tmp_path, "b.txt", "not_an_op\n")):
                pass
        assert torch.mm(x, x).dtype == BF16
    assert not hmp.is_converted()
    assert_same(pristine, snapshot())


def test_new_thread_starts_enabled_while_parent_disabled():
    hmp.convert()
    out = []
    with hmp.disable_casts():
        t = threading.Thread(target=lambda: out.append(torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype))
        t.start()
        t.join(10)
    assert out == [BF16]


# -- rules that the property test does not cover ------------------------------------------


def test_outermost_op_decides():
    hmp.convert()
    x = torch.randn(3) + 3
    # __rtruediv__ (FP32 list) is implemented with mul (BF16 list): not cast again
    y = 2 / x
    assert y.dtype == FP32
    with hmp.disable_casts():
        assert torch.equal(y, 2 / x)  # the inner mul ran in fp32 too


def test_bf16_list_casts_only_fp32():
    hmp.convert()
    a64 = torch.randn(3, 3, dtype=torch.float64)
    assert torch.mm(a64, a64).dtype == torch.float64
    ints = torch.ones(3, 3, dtype=torch.int64)
    assert torch.mm(ints, ints).dtype == torch.int64


def test_fp32_list_casts_lower_to_fp32():
    hmp.convert()
    x = torch.randn(2, 5).bfloat16()
    assert F.softmax(x, dim=-1).dtype == FP32
    assert x.softmax(-1).dtype == FP32
    assert F.cross_entropy(x, torch.tensor([1, 2])).dtype == FP32
    assert x.half().log().dtype == FP32


def test_norms_cast_only_the_input(device):
    hmp.convert()
    x = torch.randn(8, 4, 5, device=device)
    bn = torch.nn.BatchNorm1d(4).to(device)
    before = bn.running_mean.clone()
    out = bn(x)
    assert out.dtype == BF16
    assert bn.running_mean.dtype == FP32 and bn.weight.dtype == FP32
    assert not torch.equal(before, bn.running_mean)  # running stats keep updating
    with hmp.disable_casts():
        expect = x.mean(dim=(0, 2)) * bn.momentum
    torch.testing.assert_close(bn.running_mean, expect, atol=2e-2, rtol=2e-2)
    ln = torch.nn.LayerNorm(5).to(device)
    assert ln(x).dtype == BF16 and ln.weight.dtype == FP32
    gn = torch.nn.GroupNorm(2, 4).to(device)
    assert gn(x).dtype == BF16


def test_inplace_keyword_writes_the_users_tensor():
    hmp.convert()
    x = torch.randn(4, 4)
    y = F.relu(x, inplace=True)
    assert y is x and x.dtype == FP32 and (x >= 0).all()
    x = torch.randn(4, 4)
    y = F.relu(x, True)  # positional inplace
    assert y is x and x.dtype == FP32
    x = torch.ones(100)
    y = F.dropout(x, 0.5, True, True)
    assert y is x and x.dtype == FP32 and (x == 0).any()


def test_out_argument_is_written():
    hmp.convert()
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    out = torch.empty(3, 3)
    res = torch.mm(a, b, out=out)
    assert res is out and out.dtype == FP32
    with hmp.disable_casts():
        expect = torch.mm(a, b)  # the in-place rule: inputs take the dtype of out
    assert torch.equal(out, expect)


def test_inplace_update_of_fp32_parameter_stays_fp32():
    hmp.convert()
    p = torch.nn.Parameter(torch.randn(4))
    with torch.no_grad():
        p.mul_(torch.randn(4).bfloat16())
        p += torch.ones(4).bfloat16()
        p *= 2
    assert p.dtype == FP32 and isinstance(p, torch.nn.Parameter)


def test_autograd_flows_through_casts(device):
    hmp.convert()
    w = torch.randn(3, 4, device=device, requires_grad=True)
    x = torch.randn(2, 4, device=device, requires_grad=True)
    y = F.linear(x, w)
    assert y.dtype == BF16
    F.softmax(y, -1)[:, 0].sum().backward()
    assert w.grad.dtype == FP32 and x.grad.dtype == FP32
    assert torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0


def test_unlisted_ops_are_untouched():
    hmp.convert()
    assert torch.sin is vars(torch)["sin"] and not hasattr(torch.sin, "__hmp_original__")
    x = torch.randn(3).bfloat16()
    assert torch.sin(x).dtype == BF16


# -- options ----------------------------------------------------------------------------------


def test_fp16_low_precision(device):
    hmp.convert(low_precision_type=torch.float16)
    x = torch.randn(2, 4, device=device)
    assert F.linear(x, torch.randn(3, 4, device=device)).dtype == torch.float16
    assert F.softmax(x.half(), -1).dtype == FP32


def test_o2_lists(tmp_path):
    hmp.convert(opt_level="O2")
    lists = hmp.effective_lists()
    assert lists["bf16"] == sorted("addmm baddbmm bilinear bmm conv1d conv2d conv3d conv_transpose1d conv_transpose2d "
                                   "conv_transpose3d dot linear matmul mm mv "
                                   "lstm gru rnn_tanh rnn_relu lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell".split())
    assert {"relu", "mul", "softmax", "layer_norm", "dropout", "t"} <= set(lists["fp32"])
    x = torch.randn(4, 4)
    assert F.linear(x, x).dtype == BF16
    assert F.relu(x.bfloat16()).dtype == FP32
    assert "add" in lists["promote"]


def test_o2_ignores_user_files_with_warning(tmp_path):
    with pytest.warns(UserWarning, match="O2"):
        hmp.convert(opt_level="O2", bf16_file_path=write(tmp_path, "b.txt", "relu\n"))
    assert "relu" in hmp.effective_lists()["fp32"]


def test_verbose_logs_through_logging(caplog, capsys):
    with caplog.at_level(logging.DEBUG, logger="hmp"):
        hmp.convert(isVerbose=True)
        F.linear(torch.randn(2, 3), torch.randn(4, 3))
    text = caplog.text
    assert "bf16 list" in text and "patched torch.nn.functional.linear" in text
    assert "torch.nn.functional.linear inputs (float32, float32) -> (bfloat16, bfloat16)" in text
    hmp.revert()
    capsys.readouterr()
    hmp.convert(isVerbose=False)
    F.linear(torch.randn(2, 3), torch.randn(4, 3))
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_verbose_reaches_the_terminal_without_logging_config(tmp_path):
    import subprocess
    import sys

    code = ("import torch, hmp, torch.nn.functional as F; hmp.convert(isVerbose=True); "
            "F.linear(torch.randn(2, 3), torch.randn(4, 3)); hmp.revert(); F.linear(torch.randn(2, 3), torch.randn(4, 3))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "torch.nn.functional.linear inputs" in res.stderr and res.stdout == ""
    assert res.stderr.count("torch.nn.functional.linear inputs") == 1  # silent after revert


# -- public helpers ------------------------------------------------------------------------------


def test_op_wrap_and_cast_helpers():
    def my_op(a, b, scale=None):
        return a * b if scale is None else a * b * scale

    wrapped = hmp.op_wrap(my_op, hmp.to_bf16)
    x, y = torch.randn(3), torch.randn(3)
    assert wrapped(x, y).dtype == BF16
    assert wrapped(x, y, scale=torch.ones(3)).dtype == BF16
    with hmp.disable_casts():
        assert wrapped(x, y).dtype == FP32
    assert hmp.to_fp32(x.bfloat16()).dtype == FP32 and hmp.to_fp32(x.half()).dtype == FP32
    assert hmp.to_bf16(x.double()).dtype == torch.float64
    assert hmp.to_bf16(3) == 3
    assert wrapped.__name__ == "my_op"


def test_layer_norm_kernel_gets_fp32_weight_on_cpu():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "layer_norm" in func.overloadpacket.__name__:
                self.calls.append([a.dtype for a in args if isinstance(a, torch.Tensor)])
            return func(*args, **(kwargs or {}))

    hmp.convert()
    ln = torch.nn.LayerNorm(6)
    seen = Seen()
    with seen:
        ln(torch.randn(2, 6))
    assert seen.calls == [[BF16, FP32, FP32]]


def test_norm_falls_back_where_a_kernel_rejects_mixed_dtypes():
    """A stand-in for a device kernel (CUDA's layer_norm) that requires one dtype."""
    from hmp import policy, wrap

    calls = []

    def strict_layer_norm(x, shape, weight, bias, eps=1e-5):
        calls.append((x.dtype, weight.dtype))
        if x.dtype != weight.dtype:
            raise RuntimeError(f"expected scalar type {x.dtype} but found {weight.dtype}")
        return torch.ones_like(x)

    lower_all = policy.lower(BF16, policy.PLAIN_CASTS)
    call = wrap.mixed_or_lower(strict_layer_norm, lower_all)
    x, w, b = torch.randn(2, 4).bfloat16(), torch.randn(4), torch.randn(4)
    assert call(x, (4,), w, b).dtype == BF16
    assert calls == [(BF16, FP32), (BF16, BF16)]
    call(x, (4,), w, b)  # remembered for this device type: no failing first try
    assert calls[2:] == [(BF16, BF16)]
    assert w.dtype == FP32  # the user's weight is never changed

    def shape_error(x, shape, weight, bias):
        raise RuntimeError("normalized_shape mismatch")

    with pytest.raises(RuntimeError, match="normalized_shape"):
        wrap.mixed_or_lower(shape_error, lower_all)(x, (4,), w, b)
