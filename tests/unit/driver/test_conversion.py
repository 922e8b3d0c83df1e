"""convert(), revert() and converted(): exact undo, reconfiguring, failing
without a trace, O2, and verbose logging."""

import logging
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same, snapshot, write

import hmp

BF16, FP32 = torch.bfloat16, torch.float32


def test_revert_restores_namespaces_exactly(pristine):
    hmp.convert()
    assert "mm" in vars(torch.Tensor)  # inherited from TensorBase, set on Tensor
    hmp.revert()
    assert "mm" not in vars(torch.Tensor)  # deleted, not re-set
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


def test_o2_lists(tmp_path):
    hmp.convert(opt_level="O2")
    lists = hmp.effective_lists()
    assert lists["bf16"] == sorted(
        "addmm baddbmm bilinear bmm conv1d conv2d conv3d conv_transpose1d conv_transpose2d "
        "conv_transpose3d dot vdot linear matmul mm mv "
        "lstm gru rnn_tanh rnn_relu lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell".split()
    )
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
    assert "bf16 list" in text and "patched torch.nn.functional.linear" not in text  # one line says how many
    assert sum("hmp: patched" in r.getMessage() for r in caplog.records) == 1
    assert re.search(r"hmp: patched \d+ entry points", text)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="hmp.patches"):  # the list, for who asks
        hmp.convert(isVerbose=True)
    assert "hmp: patched torch.nn.functional.linear" in caplog.text
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

    code = (
        "import torch, hmp, torch.nn.functional as F; hmp.convert(isVerbose=True); "
        "F.linear(torch.randn(2, 3), torch.randn(4, 3)); hmp.revert(); F.linear(torch.randn(2, 3), torch.randn(4, 3))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "torch.nn.functional.linear inputs" in res.stderr and res.stdout == ""
    assert res.stderr.count("torch.nn.functional.linear inputs") == 1  # silent after revert


def test_a_call_inside_a_wrapper_that_revert_retires_finishes():
    """revert() retires the wrappers it takes out of torch (their rule set to
    None) while another thread may be inside one: the call must finish under
    the configuration it started in. Here the revert happens deterministically
    inside the call, when the wrapper asks an argument for its truth value
    (F.relu's inplace flag, read before the wrapper picks its rule)."""

    class RevertsWhenAsked:
        def __bool__(self):
            hmp.revert()
            return True

    hmp.convert(strict=True)  # relu is cast under Habana's literal rule
    relu = torch.nn.functional.relu  # the wrapper
    x = torch.randn(8) * 3
    expected = torch.relu(x.clone())
    out = relu(x.clone(), RevertsWhenAsked())
    assert not hmp.is_converted()
    assert torch.equal(out.float(), expected.bfloat16().float())  # cast as converted, when the call began
