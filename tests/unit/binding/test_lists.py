"""List files: format, defaults, precedence and errors raised before patching."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_same, snapshot, write

import hmp
from hmp.binding.kinds import FP32
from hmp.binding.list_files import default_path, names
from hmp.binding.lists import effective
from hmp.binding.module_entries import entry_key
from hmp.binding.resolve import Resolver

DEFAULT_BF16 = sorted(
    "addmm baddbmm bilinear bmm conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d "
    "dot vdot linear matmul mm mv prelu "
    "lstm gru rnn_tanh rnn_relu lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell".split()  # benchmarks/rnn_precision.py
)
# Habana's O1 list, the default under strict=True: what casts only under Habana's literal rule added
DEFAULT_BF16_STRICT = sorted(
    DEFAULT_BF16
    + "batch_norm dropout dropout1d dropout2d dropout3d group_norm instance_norm layer_norm leaky_relu mul relu".split()
)
# hmp's own FP32 entries, and every op CPU autocast computes in float32 (op_lists/autocast_cpu_fp32.txt)
DEFAULT_FP32 = sorted(
    set(
        "avg_pool3d binary_cross_entropy binary_cross_entropy_with_logits cross_entropy ctc_loss div divide embedding "
        "embedding_bag huber_loss log log2 log_softmax mse_loss multi_margin_loss multilabel_margin_loss nll_loss "
        "smooth_l1_loss softmax topk truediv".split()
    )
    | set(names(default_path("autocast_cpu_fp32.txt")))
)
PROMOTE_AT_LEAST = set("add sub mul div truediv pow addcmul addcdiv cat stack where index_put scatter_add".split())
# module entries of the default FP32 list, after its ops (resolved when their library is imported)
DEFAULT_FP32_MODULES = sorted(
    [
        "transformers.models.*.modeling_*.*RotaryEmbedding",
        "timm.layers.pos_embed_sincos.*RotaryEmbedding*",
        "diffusers.models.embeddings.Timesteps",
        "diffusers.models.embeddings.TimestepEmbedding",
    ]
)


def test_default_lists_exactly():
    hmp.convert()
    lists = hmp.effective_lists()
    assert set(lists) == {"bf16", "fp32", "promote"}
    assert lists["bf16"] == DEFAULT_BF16
    assert lists["fp32"] == DEFAULT_FP32 + DEFAULT_FP32_MODULES
    # the BF16 and FP32 lists win over the promote list
    assert PROMOTE_AT_LEAST - set(DEFAULT_BF16) - set(DEFAULT_FP32) <= set(lists["promote"])
    assert not set(lists["promote"]) & (set(DEFAULT_BF16) | set(DEFAULT_FP32))
    assert lists["promote"] == sorted(lists["promote"])


def test_every_default_entry_casts_and_strict_adds_habanas():
    """Every line of a shipped default list does what it says: each entry casts
    (or, in the promote list, is torch's own where torch promotes it); strict's
    default is Habana's O1 list, each of whose extra entries casts only there."""
    hmp.convert()
    detail = hmp.effective_lists(detail=True)
    ops = {kind: {n: why for n, why in detail[kind].items() if not why.startswith("module entry")} for kind in detail}
    assert set(ops["bf16"].values()) == set(ops["fp32"].values()) == {"cast"}
    assert sorted(n for n, why in detail["fp32"].items() if why.startswith("module entry")) == DEFAULT_FP32_MODULES
    hmp.convert(strict=True)
    detail = hmp.effective_lists(detail=True)
    assert sorted(detail["bf16"]) == DEFAULT_BF16_STRICT and set(detail["bf16"].values()) == {"cast"}
    hmp.convert(bf16_file_path=hmp.list_path("bf16_strict"))
    detail = hmp.effective_lists(detail=True)["bf16"]
    left = {n for n, why in detail.items() if why != "cast"}
    # torch 2.4's tags omit pointwise on leaky_relu (docs/never-changes.md): there it casts
    untagged = set() if torch.Tag.pointwise in torch.ops.aten.leaky_relu.default.tags else {"leaky_relu"}
    assert left == set(DEFAULT_BF16_STRICT) - set(DEFAULT_BF16) - untagged
    assert all("not cast outside strict mode" in detail[n] for n in left)


def test_effective_lists_empty_when_not_converted():
    assert hmp.effective_lists() == {"bf16": [], "fp32": [], "promote": []}
    assert not hmp.is_converted()


@pytest.mark.parametrize("blank", ["", None])
def test_empty_or_none_means_default(blank):
    hmp.convert(bf16_file_path=blank, fp32_file_path=blank)
    assert hmp.effective_lists()["bf16"] == DEFAULT_BF16


def test_format_tolerance(tmp_path):
    text = "\ufeff  linear  \r\n\r\n# a comment\r\nmm # trailing comment\r\n\t conv2d\t\n\nlinear\n"
    path = write(tmp_path, "bf16.txt", text.encode("utf-8"), mode="wb")
    hmp.convert(bf16_file_path=path)
    assert hmp.effective_lists()["bf16"] == ["conv2d", "linear", "mm"]


def test_pathlike_and_str(tmp_path):
    path = write(tmp_path, "fp32.txt", "softmax\n")
    hmp.convert(fp32_file_path=str(path))
    assert hmp.effective_lists()["fp32"] == ["softmax"]
    hmp.convert(fp32_file_path=Path(path))
    assert hmp.effective_lists()["fp32"] == ["softmax"]


def test_user_file_replaces_default(tmp_path):
    hmp.convert(bf16_file_path=write(tmp_path, "b.txt", "linear\n"))
    lists = hmp.effective_lists()
    assert lists["bf16"] == ["linear"]
    assert lists["fp32"] == DEFAULT_FP32 + DEFAULT_FP32_MODULES


def test_single_user_list_wins_over_other_default(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hmp"):
        hmp.convert(bf16_file_path=write(tmp_path, "b.txt", "softmax\nlinear\n"))
    lists = hmp.effective_lists()
    assert "softmax" in lists["bf16"] and "softmax" not in lists["fp32"]
    assert any("softmax" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    # and the other way round
    hmp.convert(fp32_file_path=write(tmp_path, "f.txt", "linear\n"))
    lists = hmp.effective_lists()
    assert lists["fp32"] == ["linear"] and "linear" not in lists["bf16"]
    x = torch.randn(2, 4)
    assert torch.nn.functional.linear(x.bfloat16(), torch.randn(3, 4)).dtype == torch.float32


def test_promote_file_replaces_promote_list(tmp_path):
    hmp.convert(promote_file_path=write(tmp_path, "p.txt", "add\nmaximum\nmul\n"))
    assert hmp.effective_lists()["promote"] == ["add", "maximum", "mul"]
    a, b = torch.randn(3), torch.randn(3).bfloat16()
    assert torch.maximum(a, b).dtype == torch.float32
    assert torch.cat([a, b]).dtype == torch.float32  # cat is no longer in any list: torch's own promotion


def test_unknown_op_names_file_line_and_suggestion(tmp_path, pristine):
    path = write(tmp_path, "bf16.txt", "linear\n\n# c\nlinaer\n")
    with pytest.raises(ValueError) as info:
        hmp.convert(bf16_file_path=path)
    msg = str(info.value)
    assert str(path) in msg and "line 4" in msg and "'linaer'" in msg and "linear" in msg.split("did you mean")[1]
    assert not hmp.is_converted()


def test_invalid_name_and_bad_utf8(tmp_path, pristine):
    path = write(tmp_path, "b.txt", b"linear\nmm\xff\xfe\n", mode="wb")
    with pytest.raises(ValueError, match=r"line 2.*UTF-8"):
        hmp.convert(bf16_file_path=path)
    path = write(tmp_path, "c.txt", "linear\nnot an op\n")
    with pytest.raises(ValueError, match=r"c\.txt.*\n.*line 2: 'not an op' is not an op name"):
        hmp.convert(bf16_file_path=path)


def test_conflict_between_two_user_files(tmp_path, pristine):
    b = write(tmp_path, "b.txt", "linear\nsoftmax\nmm\n")
    f = write(tmp_path, "f.txt", "softmax\nmm\n")
    with pytest.raises(ValueError, match="mm, softmax"):
        hmp.convert(bf16_file_path=b, fp32_file_path=f)


def test_missing_file_and_directory(tmp_path, pristine):
    missing = tmp_path / "nope.txt"
    with pytest.raises(OSError, match="nope.txt"):
        hmp.convert(bf16_file_path=missing)
    with pytest.raises(OSError, match=str(tmp_path)):
        hmp.convert(fp32_file_path=tmp_path)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path, pristine):
    path = write(tmp_path, "b.txt", "linear\n")
    path.chmod(0)
    with pytest.raises(OSError, match="b.txt"):
        hmp.convert(bf16_file_path=path)


def test_wrong_path_type(pristine):
    with pytest.raises(TypeError, match="bf16_file_path|BF16"):
        hmp.convert(bf16_file_path=3)


def test_failed_convert_keeps_previous_conversion(tmp_path):
    hmp.convert(bf16_file_path=write(tmp_path, "b.txt", "linear\n"))
    before = snapshot()
    with pytest.raises(ValueError):
        hmp.convert(bf16_file_path=write(tmp_path, "bad.txt", "linearr\n"))
    assert_same(before, snapshot())
    assert hmp.effective_lists()["bf16"] == ["linear"]


def test_bad_options(pristine):
    with pytest.raises(ValueError, match="opt_level"):
        hmp.convert(opt_level="O3")
    with pytest.raises(ValueError, match="low_precision_type"):
        hmp.convert(low_precision_type=torch.float64)
    with pytest.raises(TypeError, match="isVerbose"):
        hmp.convert(isVerbose="yes")


def _module_entries(path):
    """The module patterns a list file names itself (dotted lines), read from the file."""
    lines = (line.split("#", 1)[0].strip() for line in Path(path).read_text().splitlines())
    return [line for line in lines if "." in line and not line.startswith(("-", "include"))]


@pytest.mark.parametrize("gone", _module_entries(hmp.list_path("fp32")))
def test_a_minus_pattern_line_takes_out_exactly_that_module_entry(tmp_path, gone):
    """docs/modules.md: ``-pattern`` after ``include default`` takes one module entry out."""
    shipped = _module_entries(hmp.list_path("fp32"))
    assert len(shipped) >= 4  # the shipped rotary and timestep patterns
    fp32 = write(tmp_path, "fp32.txt", f"include default\n-{gone}\n")
    _, classes = effective(Resolver(), sources={FP32: fp32}, environ={})
    assert [entry_key(m) for m in classes[FP32]] == [m for m in shipped if m != gone]
    _, classes = effective(Resolver(), environ={})
    assert [entry_key(m) for m in classes[FP32]] == shipped


def test_a_minus_line_for_a_library_not_installed_loads_and_imports_nothing(tmp_path):
    """tune writes a '-' line for each shipped module entry it takes out; such a file loads where the
    library is not installed, and a '-' line imports nothing (a fresh process: diffusers stays out)."""
    gone = "diffusers.models.embeddings.Timesteps"
    fp32 = write(tmp_path, "fp32.txt", f"include default\n-nosuchlib_hmp.models.Block\n-{gone}\n")
    code = (
        "import sys, hmp\n"
        "from hmp.binding.kinds import FP32\n"
        "from hmp.binding.lists import effective\n"
        "from hmp.binding.module_entries import entry_key\n"
        "from hmp.binding.resolve import Resolver\n"
        f"_, classes = effective(Resolver(), sources={{FP32: {str(fp32)!r}}}, environ={{}})\n"
        "keys = [entry_key(m) for m in classes[FP32]]\n"
        f"assert {gone!r} not in keys and keys, keys\n"
        "assert 'nosuchlib_hmp' not in sys.modules and 'diffusers' not in sys.modules\n"
        f"hmp.convert(fp32_file_path={str(fp32)!r}); hmp.revert(); print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
