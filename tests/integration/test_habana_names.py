"""Op names as Habana's lists wrote them: aten operator names with no torch /
F / Tensor entry of that name, ``op.overload``, real aten operators nothing in
Python reaches, typos mixed in; through every route a list takes (convert()
arguments, LOWER_LIST / FP32_LIST, PT_HPU_AUTOCAST_*, a gaudi config). Also
optimum-habana's default lists, ``fp16_file_path`` and a Habana-style MNIST
script under ``python -m hmp run``."""

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same, snapshot, write
from hypothesis import given, settings
from hypothesis import strategies as st

import hmp
from hmp.binding import lists
from hmp.binding.resolve import Resolver

ROOT = Path(__file__).resolve().parents[2]

# every namespace an aten name can bind, by identity
NAMESPACES = {
    "torch": torch,
    "torch.nn.functional": F,
    "torch.Tensor": torch.Tensor,
    "torch._C._nn": torch._C._nn,
    "torch._C._linalg": torch._C._linalg,
    "torch.linalg": torch.linalg,
    "torch._C._special": torch._C._special,
    "torch.special": torch.special,
    "torch._C._fft": torch._C._fft,
    "torch.fft": torch.fft,
}


# Ground truth for each name form, written by hand from what torch has:
# (what the entry stands for in effective_lists(), or None when it has
# nothing to bind; or "unknown").
NAMES = {
    "linear": "linear",
    "cross_entropy_loss": "cross_entropy_loss",  # F.cross_entropy calls torch._C._nn.cross_entropy_loss
    "nll_loss2d": "nll_loss2d",
    "linalg_multi_dot": "linalg_multi_dot",  # torch.linalg.multi_dot
    "log_sigmoid": "log_sigmoid",  # F.logsigmoid
    "_convolution.deprecated": "_convolution",
    "conv_transpose2d.input": "conv_transpose2d",
    "conv_transpose3d.input": "conv_transpose3d",
    "pow.Tensor_Scalar": "pow",
    "mm.default": "mm",
    "slice": None,  # Tensor.__getitem__ reaches it from C++
    "convolution_overrideable": None,
    "linaer": "unknown",
    "cross_entropy_los": "unknown",
    "embedding_bag_sum_fwd": "unknown",  # a Habana-only kernel
    "pow.Foo": "unknown",
    "torch.linear": "unknown",
    "linalg_multi_dot.out_of_range": "unknown",
}
BOUND = [n for n, v in NAMES.items() if v not in (None, "unknown")]
UNBINDABLE = [n for n, v in NAMES.items() if v is None]
UNKNOWN = [n for n, v in NAMES.items() if v == "unknown"]


def load(path):
    """lists.load with warnings recorded: (names, [warning texts])."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = lists.load(path, Resolver(), "BF16 list file").ops
    return names, [str(w.message) for w in caught if "hmp" in str(w.message)]


@settings(deadline=None)
@given(entries=st.lists(st.sampled_from(sorted(NAMES)), max_size=12))
def test_each_name_form_loads_or_fails_as_specified(tmp_path_factory, entries):
    path = tmp_path_factory.mktemp("l") / "ops.txt"
    path.write_text("".join(f"{n}\n" for n in entries))
    bad = [(i, n) for i, n in enumerate(entries, start=1) if NAMES[n] == "unknown"]
    if bad:
        with pytest.raises(ValueError) as err:
            load(path)
        text = str(err.value)
        assert str(path) in text
        reported = [int(m) for m in re.findall(r"line (\d+):", text)]
        assert reported == [i for i, _ in bad][: lists.SHOWN]  # only the unknown names, in file order
        return
    names, warned = load(path)
    expected = []
    for n in entries:
        if NAMES[n] and NAMES[n] not in expected:
            expected.append(NAMES[n])
    assert names == expected
    unbindable = sorted({n for n in entries if NAMES[n] is None})
    if unbindable:
        assert len(warned) == 1 and "nothing to bind in Python; calls reach it from C++" in warned[0]
        assert sorted(re.findall(r"aten::(\w+)", warned[0])) == unbindable and str(path) in warned[0]
    else:
        assert warned == []


def test_errors_name_the_line_and_suggest(tmp_path):
    path = write(
        tmp_path,
        "ops.txt",
        "cross_entropy_loss\nslice\ncross_entropy_los\npow.Foo\ntorch.linear\n"
        "embedding_bag_sum_fwd\npow.Tensor_Scalar\n",
    )
    with pytest.raises(ValueError) as err:
        load(path)
    text = str(err.value)
    assert "line 3: unknown op 'cross_entropy_los'; did you mean cross_entropy_loss" in text
    assert "line 4: unknown overload 'pow.Foo': aten::pow has pow.Tensor_Tensor, pow.Tensor_Scalar" in text
    assert "line 5: unknown op 'torch.linear'" in text and "did you mean linear?" in text
    assert "line 6: unknown op 'embedding_bag_sum_fwd'" in text
    assert not re.search(r"line [127]:", text)


def test_aten_names_bind_every_python_entry_point():
    labels = {n: {s.label for s in Resolver().sites(NAMES[n])} for n in BOUND}
    assert labels["cross_entropy_loss"] == {"torch._C._nn.cross_entropy_loss"}
    assert labels["linalg_multi_dot"] == {"torch.linalg.multi_dot", "torch._C._linalg.linalg_multi_dot"}
    assert {"torch.nn.functional.logsigmoid", "torch._C._nn.log_sigmoid"} <= labels["log_sigmoid"]
    assert {"torch.nn.functional.conv_transpose2d", "torch.conv_transpose2d"} <= labels["conv_transpose2d.input"]
    assert {"torch.pow", "torch.Tensor.pow", "torch.Tensor.__pow__"} <= labels["pow.Tensor_Scalar"]


def test_converted_aten_names_cast_through_the_public_functions(pristine):
    """cross_entropy_loss in the FP32 list reaches F.cross_entropy; multi_dot and
    an overload-qualified pow in the BF16 list reach torch.linalg.multi_dot and
    torch.pow / ``**``."""
    before = snapshot(NAMESPACES)
    with pytest.warns(UserWarning, match=r"aten::slice.*nothing to bind"):
        hmp.convert(
            bf16_file_path=_file("linalg_multi_dot\npow.Tensor_Scalar\nslice\n"),
            fp32_file_path=_file("cross_entropy_loss\nnll_loss2d\n"),
            strict=True,  # Habana's rule: pow (pointwise) casts as on HPU
        )
    assert hmp.effective_lists()["bf16"] == ["linalg_multi_dot", "pow"]
    assert hmp.effective_lists()["fp32"] == ["cross_entropy_loss", "nll_loss2d"]
    logits = torch.randn(4, 5, dtype=torch.bfloat16, requires_grad=True)
    loss = F.cross_entropy(logits, torch.tensor([0, 1, 2, 3]))
    assert loss.dtype == torch.float32
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16
    a, b, c = torch.randn(3, 4), torch.randn(4, 5), torch.randn(5, 2)
    assert torch.linalg.multi_dot([a, b, c]).dtype == torch.bfloat16
    assert torch.pow(a, 2).dtype == torch.bfloat16 and (a**2).dtype == torch.bfloat16
    img = torch.randn(2, 3, 4, 4, dtype=torch.bfloat16)
    target = torch.randint(0, 3, (2, 4, 4))
    assert torch._C._nn.nll_loss2d(img, target).dtype == torch.float32
    hmp.revert()
    assert_same(before, snapshot(NAMESPACES))


def _file(text, folder=None):
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".txt", dir=folder)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


GOOD_BF16 = (
    "linear\n_convolution.deprecated\nconv_transpose2d.input\nconv_transpose3d.input\npow.Tensor_Scalar\nslice\n"
)
GOOD_FP32 = "cross_entropy_loss\nnll_loss2d\nlinalg_multi_dot\nconvolution_overrideable\n"
BAD_BF16 = "linear\nslice\nlinaer\npow.Tensor_Scalar\nembedding_bag_sum_fwd\n"
GOOD_LISTS = {
    "bf16": ["_convolution", "conv_transpose2d", "conv_transpose3d", "linear", "pow"],
    "fp32": ["cross_entropy_loss", "linalg_multi_dot", "nll_loss2d"],
}


def _names(text):
    return [line for line in text.splitlines() if line]


def via_arguments(tmp_path, bf16, fp32, monkeypatch):
    hmp.convert(bf16_file_path=write(tmp_path, "b.txt", bf16), fp32_file_path=write(tmp_path, "f.txt", fp32))


def via_lightning_env(tmp_path, bf16, fp32, monkeypatch):
    monkeypatch.setenv("LOWER_LIST", str(write(tmp_path, "b.txt", bf16)))
    monkeypatch.setenv("FP32_LIST", str(write(tmp_path, "f.txt", fp32)))
    hmp.convert()


def via_autocast_env(tmp_path, bf16, fp32, monkeypatch):
    monkeypatch.setenv("PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST", str(write(tmp_path, "b.txt", bf16)))
    monkeypatch.setenv("PT_HPU_AUTOCAST_FP32_OPS_LIST", str(write(tmp_path, "f.txt", fp32)))
    hmp.convert()


def via_gaudi_config(tmp_path, bf16, fp32, monkeypatch):
    config = {"use_habana_mixed_precision": True, "hmp_bf16_ops": _names(bf16), "hmp_fp32_ops": _names(fp32)}
    hmp.convert_from_config(write(tmp_path, "gaudi_config.json", json.dumps(config)))


ROUTES = [via_arguments, via_lightning_env, via_autocast_env, via_gaudi_config]


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.__name__)
def test_every_route_loads_the_name_forms(route, tmp_path, monkeypatch, pristine):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        route(tmp_path, GOOD_BF16, GOOD_FP32, monkeypatch)
    texts = [str(w.message) for w in caught if "nothing to bind" in str(w.message)]
    # one per list file (one for a whole config), naming each op and where it was
    assert len(texts) == (1 if route is via_gaudi_config else 2), texts
    assert any("aten::slice" in t for t in texts) and any("aten::convolution_overrideable" in t for t in texts)
    where = "hmp_bf16_ops[5]: aten::slice" if route is via_gaudi_config else "line 6: aten::slice"
    assert any(where in t for t in texts)
    lists_now = hmp.effective_lists()
    assert {k: lists_now[k] for k in GOOD_LISTS} == GOOD_LISTS
    assert F.cross_entropy(torch.randn(2, 3, dtype=torch.bfloat16), torch.tensor([0, 2])).dtype == torch.float32
    assert torch.linalg.multi_dot([torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(3, 2)]).dtype == torch.float32


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.__name__)
def test_every_route_rejects_typos_and_patches_nothing(route, tmp_path, monkeypatch):
    hmp.revert()
    before = snapshot(NAMESPACES)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError) as err:
            route(tmp_path, BAD_BF16, GOOD_FP32, monkeypatch)
    text = str(err.value)
    if route is via_gaudi_config:
        assert "hmp_bf16_ops[2]: unknown op 'linaer'; did you mean linear" in text
        assert "hmp_bf16_ops[4]: unknown op 'embedding_bag_sum_fwd'" in text
        assert "[1]" not in text and "[3]" not in text
    else:
        assert str(tmp_path / "b.txt") in text
        assert "line 3: unknown op 'linaer'; did you mean linear" in text
        assert "line 5: unknown op 'embedding_bag_sum_fwd'" in text
        assert re.findall(r"line (\d+):", text) == ["3", "5"]
    assert not [w for w in caught if "nothing to bind" in str(w.message)]  # a failed load only raises
    assert not hmp.is_converted()
    assert_same(before, snapshot(NAMESPACES))


def test_a_failed_load_over_a_conversion_keeps_it(tmp_path):
    hmp.convert(fp32_file_path=write(tmp_path, "f.txt", "cross_entropy_loss\n"))
    before, lists_before = snapshot(NAMESPACES), hmp.effective_lists()
    with pytest.raises(ValueError):
        hmp.convert(fp32_file_path=write(tmp_path, "g.txt", "linalg_multi_dot\nlinalg_multi_dto\n"))
    assert_same(before, snapshot(NAMESPACES))
    assert hmp.effective_lists() == lists_before


def test_overloads_of_one_op_in_both_user_lists_is_an_error(tmp_path):
    """An overload binds its op as a whole, so two overloads of one op cannot
    go to two lists."""
    with pytest.raises(ValueError, match="ops in both.*pow"):
        hmp.convert(
            bf16_file_path=write(tmp_path, "b.txt", "pow.Tensor_Scalar\n"),
            fp32_file_path=write(tmp_path, "f.txt", "pow.Scalar\n"),
        )


# -- fp16_file_path ----------------------------------------------------------------------------


def test_fp16_file_path_is_the_list_under_float16(tmp_path, pristine):
    hmp.convert(fp16_file_path=write(tmp_path, "h.txt", "linear\n"), low_precision_type=torch.float16)
    assert hmp.effective_lists()["bf16"] == ["linear"]
    assert F.linear(torch.randn(2, 3), torch.randn(4, 3)).dtype == torch.float16
    assert torch.mm(torch.randn(2, 3), torch.randn(3, 2)).dtype == torch.float32  # not in that list


def test_fp16_file_path_wins_over_bf16_file_path_under_float16(tmp_path, pristine):
    with pytest.warns(UserWarning, match="bf16_file_path .* is ignored"):
        hmp.convert(
            bf16_file_path=write(tmp_path, "b.txt", "mm\n"),
            fp16_file_path=write(tmp_path, "h.txt", "linear\n"),
            low_precision_type=torch.float16,
        )
    assert hmp.effective_lists()["bf16"] == ["linear"]


def test_fp16_file_path_is_ignored_under_bfloat16(tmp_path, pristine):
    with pytest.warns(UserWarning, match="fp16_file_path .* is ignored"):
        hmp.convert(
            bf16_file_path=write(tmp_path, "b.txt", "mm\n"), fp16_file_path=write(tmp_path, "h.txt", "linear\n")
        )
    assert hmp.effective_lists()["bf16"] == ["mm"]


def test_bad_fp16_file_names_it(tmp_path):
    path = write(tmp_path, "h.txt", "linaer\n")
    with pytest.raises(ValueError, match=r"FP16 list file .*h\.txt.*\n.*line 1: unknown op 'linaer'"):
        hmp.convert(fp16_file_path=path, low_precision_type=torch.float16)
    assert not hmp.is_converted()


def test_habanas_positional_order_is_a_clear_error(tmp_path):
    """Habana's later HMP had fp16_file_path 4th; here the 4th is isVerbose."""
    with pytest.raises(TypeError, match="fp16_file_path= by keyword"):
        hmp.convert("O1", "", "", str(write(tmp_path, "h.txt", "linear\n")))


# -- a Habana-style MNIST script -----------------------------------------------------------------


def _run_mnist(tmp_path, *args):
    (tmp_path / "ops_bf16_mnist.txt").write_text("conv2d\nlinear\nrelu\nmax_pool2d\n_convolution.deprecated\n")
    (tmp_path / "ops_fp32_mnist.txt").write_text("log_softmax\nnll_loss\nnll_loss2d\ncross_entropy_loss\nslice\n")
    # HMP_STRICT=1: Habana's literal rule (relu casts too), as the script ran on HPU
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HMP_STRICT": "1"}
    return subprocess.run(
        [sys.executable, "-m", "hmp", "run", str(ROOT / "tests" / "helpers" / "habana_mnist.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def _out(stdout):
    return dict(line.split(" ", 1) for line in stdout.splitlines() if " " in line)


NO_HABANA = pytest.mark.skipif(
    importlib.util.find_spec("habana_frameworks") is not None, reason="Habana software installed"
)


@pytest.mark.slow
@pytest.mark.torch_internals
@NO_HABANA
def test_habana_style_mnist_runs_under_hmp_run(tmp_path):
    res = _run_mnist(tmp_path, "--hmp", "--hmp-verbose", "--hmp-opt-level", "O1")
    assert res.returncode == 0, res.stderr
    out = _out(res.stdout)
    first, last = map(float, out["loss"].split())
    assert last < first
    # conv2d in bf16 (BF16 list), log_softmax fp32 (FP32 list), parameters and gradients fp32
    assert out["dtypes"] == "torch.bfloat16 torch.float32 torch.float32 torch.float32"
    assert re.search(r"hmp: patched \d+ entry points", res.stderr)  # verbose: one line, not one per entry point
    assert "nll_loss2d" in res.stderr and "cross_entropy_loss" in res.stderr  # aten-only names, listed
    assert res.stderr.count("nothing to bind in Python") == 1 and "aten::slice" in res.stderr
    res = _run_mnist(tmp_path, "--hmp", "--hmp-opt-level", "O2")
    assert res.returncode == 0, res.stderr
    assert _out(res.stdout)["dtypes"] == "torch.bfloat16 torch.float32 torch.float32 torch.float32"


@NO_HABANA
def test_debug_modules_are_no_ops_and_working_modules_stay_errors():
    from hmp.integrations import habana_runner as legacy

    legacy.install()
    try:
        htdebug = importlib.import_module("habana_frameworks.torch.utils.debug")
        from habana_frameworks.torch.utils.debug import _dump_memory_reporter  # noqa: E402

        assert _dump_memory_reporter() is None and htdebug._memstat_livealloc("step 1") is None
        assert not hasattr(htdebug, "__wrapped__")  # dunder lookups still fail
        for working in (
            "habana_frameworks.torch.hpex.optimizers",
            "habana_frameworks.torch.distributed.hccl",
            "habana_frameworks.torch.utils.debug.dynamo_utils",
        ):
            with pytest.raises(ModuleNotFoundError, match="Habana software is not installed"):
                importlib.import_module(working)
    finally:
        legacy.uninstall()
