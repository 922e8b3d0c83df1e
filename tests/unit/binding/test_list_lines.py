"""What a list file may say (docs/lists.md): extending a default list
(``include default``, ``include <shipped list>``, ``-name``), names that are
not precision choices refused with their file and line, one warning for a
file that drops the default FP32 or promote ops or is empty, and advice in
hmp's own notes that keeps the defaults."""

import subprocess
import sys
import warnings

import pytest
import torch
from helpers import assert_same, snapshot, write
from hypothesis import given, settings
from hypothesis import strategies as st

import hmp
from hmp.binding import list_files, lists

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _names(name):
    return sorted(set(list_files.names(hmp.list_path(name))))


def _defaults():
    hmp.convert()
    out = hmp.effective_lists()
    hmp.revert()
    return out


# -- extending ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bf16", "fp32", "promote"])
def test_include_default_extends_the_default_list(tmp_path, kind):
    defaults = _defaults()
    extra = {"bf16": "einsum", "fp32": "erfinv", "promote": "nextafter"}[kind]
    path = write(tmp_path, "l.txt", f"# mine\ninclude default\n{extra}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # extending drops nothing: no warning
        hmp.convert(**{f"{kind}_file_path": path})
    assert set(hmp.effective_lists()[kind]) == set(defaults[kind]) | {extra}


def test_a_name_taken_out_and_a_name_moved(tmp_path):
    defaults = _defaults()
    bf16 = write(tmp_path, "b.txt", "include default\n-mul\nsoftmax\n")  # softmax: explicit, wins over FP32
    hmp.convert(bf16_file_path=bf16)
    got = hmp.effective_lists()
    assert "mul" not in got["bf16"] and "softmax" in got["bf16"] and "softmax" not in got["fp32"]
    assert set(got["bf16"]) == set(defaults["bf16"]) - {"mul"} | {"softmax"}


def test_include_a_shipped_list_by_name_and_list_path(tmp_path):
    assert hmp.list_path("bf16").is_file() and hmp.list_path("fp16").is_file()
    with pytest.raises(ValueError, match="no shipped list named 'nope'"):
        hmp.list_path("nope")
    path = write(tmp_path, "f.txt", "include bf16\n")  # the seed's list, run in float16
    hmp.convert(low_precision_type=FP16, fp16_file_path=path)
    assert hmp.effective_lists()["bf16"] == _names("bf16")
    assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == FP16


def test_an_explicit_name_in_both_user_files_is_still_an_error(tmp_path, pristine):
    b = write(tmp_path, "b.txt", "include default\nsoftmax\n")
    f = write(tmp_path, "f.txt", "include default\nsoftmax\n")
    with pytest.raises(ValueError, match="ops in both.*softmax"):
        hmp.convert(bf16_file_path=b, fp32_file_path=f)
    assert_same(pristine, snapshot())


def test_bad_include_and_a_listed_name_taken_out_name_their_lines(tmp_path, pristine):
    path = write(tmp_path, "b.txt", "linear\ninclude nothing_here\nmm\n-mm\n-linaer\n")
    with pytest.raises(ValueError) as e:
        hmp.convert(bf16_file_path=path)
    text = str(e.value)
    assert str(path) in text
    assert "line 2: 'include nothing_here'" in text and "no shipped list" in text
    assert "line 4: 'mm' is both listed (line 3) and taken out" in text
    assert "line 5: unknown op 'linaer'" in text
    assert_same(pristine, snapshot())


def test_syntax_errors_and_unknown_names_are_reported_together(tmp_path):
    path = write(tmp_path, "b.txt", "linaer\nnot a name\nmm\n")
    with pytest.raises(ValueError) as e:
        hmp.convert(bf16_file_path=path)
    assert "line 1: unknown op 'linaer'" in str(e.value) and "line 2: 'not a name'" in str(e.value)


# -- a list holds precision choices only -----------------------------------------------------------


def _schema_views():
    """Every aten op any overload of which returns an alias of an input
    (and writes nothing), straight from torch's schemas."""
    views = set()
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith("aten::") and any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        ):
            views.add(schema.name[6:])
    return views


_BOUND_VIEWS = sorted(v for v in _schema_views() if hmp.binding.resolve.Resolver().exists(v) and v != "t")
_NOT_PRECISION = [
    "__getitem__",
    "__setitem__",
    "clone",
    "copy_",
    "fill_",
    "zero_",
    "float",
    "half",
    "bfloat16",
    "type_as",
    "to",
    "contiguous",
    "detach",
    "cpu",
    "view_copy",
    "t_copy",
    "transpose_copy",
]


@settings(deadline=None)
@given(
    name=st.sampled_from(_BOUND_VIEWS + _NOT_PRECISION),
    kind=st.sampled_from(["bf16", "fp32", "promote"]),
    line=st.integers(1, 4),
)
def test_names_that_copy_alias_move_or_write_are_skipped_with_file_and_line(tmp_path_factory, name, kind, line):
    """Habana's own list files name view, unsqueeze, expand; apex's FP32 list
    names cpu: such a file loads, with one warning naming the file, the line
    and the name, and nothing is cast through the name."""
    path = tmp_path_factory.mktemp("l") / "l.txt"
    path.write_text("\n" * (line - 1) + f"{name}  # not a precision choice\nnextafter\n")
    with pytest.warns(UserWarning) as record:
        hmp.convert(**{f"{kind}_file_path": path})
    said = [str(w.message) for w in record if "not a precision choice" in str(w.message)]
    assert len(said) == 1 and str(path) in said[0] and f"line {line}: '{name}'" in said[0], said
    lists = hmp.effective_lists()
    assert name not in lists[kind] and "nextafter" in lists[kind]


def test_the_seeds_t_stays_accepted(tmp_path):
    """Habana's published lists name t (a view): such a file loads without a
    word, and the line binds nothing (effective_lists says why)."""
    path = tmp_path / "habana_bf16.txt"
    path.write_text("linear\nt\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hmp.convert(bf16_file_path=path)
    assert "t" in hmp.effective_lists()["bf16"]
    assert "returns a view" in hmp.effective_lists(detail=True)["bf16"]["t"]
    x = torch.randn(2, 3)
    assert x.t()._base is x


# -- one warning when a user file drops default ops or is empty ------------------------------------


def test_a_user_fp32_file_that_drops_losses_warns_once_in_one_short_line(tmp_path):
    """A faithful copy of another library's FP32 list (it restates that library's default, not hmp's) draws
    one line per file, with how many default ops it leaves out and where to see them: not a paragraph
    naming ninety ops at every convert()."""
    path = write(tmp_path, "f.txt", "softmax\n")
    with pytest.warns(UserWarning) as record:
        hmp.convert(fp32_file_path=path)
    texts = [str(w.message) for w in record if "leaves out" in str(w.message)]
    shipped = {n for n in list_files.names(hmp.list_path("fp32")) if "." not in n}  # its ops, not its patterns
    now = hmp.effective_lists()
    dropped = shipped - set(now["fp32"]) - set(now["bf16"]) - set(now["promote"])
    assert len(texts) == 1 and "\n" not in texts[0] and len(texts[0]) < 300 + len(str(path)), texts
    assert f"leaves out {len(dropped)} of its {len(shipped)} ops" in texts[0] and "hmp.list_path('fp32')" in texts[0]
    assert "include default" in texts[0] and str(path) in texts[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hmp.convert(fp32_file_path=path)  # once


def test_ops_moved_on_purpose_are_not_called_dropped(tmp_path):
    b = write(tmp_path, "b.txt", "include default\nsoftmax\n")
    f = write(tmp_path, "f.txt", "include default\n-softmax\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hmp.convert(bf16_file_path=b, fp32_file_path=f)
    assert "softmax" in hmp.effective_lists()["bf16"]


@pytest.mark.parametrize("kind", ["bf16", "fp32", "promote"])
def test_an_empty_user_file_warns(tmp_path, kind):
    path = write(tmp_path, f"empty_{kind}.txt", "# nothing yet\n")
    with pytest.warns(UserWarning, match="is empty"):
        hmp.convert(**{f"{kind}_file_path": path})
    assert hmp.effective_lists()[kind] == []


def test_the_readme_list_file_example_keeps_losses_in_float32(tmp_path):
    readme = list_files.list_dir().parent / "README.md"
    if not readme.is_file():
        pytest.skip("an installed copy without README.md")
    text = readme.read_text()
    block = text.split("# my_fp32.txt", 1)[1].split("```", 1)[0]
    path = write(
        tmp_path,
        "my_fp32.txt",
        "# my_fp32.txt" + block.replace("transformers.models.llama.modeling_llama.LlamaRMSNorm", ""),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hmp.convert(fp32_file_path=path)
    assert {"cross_entropy", "nll_loss", "log_softmax", "softmax"} <= set(hmp.effective_lists()["fp32"])


# -- float16 is not bfloat16 ----------------------------------------------------------------------


def test_float16_defaults_to_the_gemm_family():
    hmp.convert(low_precision_type=FP16)
    got = hmp.effective_lists()
    assert got["bf16"] == _names("fp16")
    assert {"linear", "matmul", "conv2d", "bmm"} <= set(got["bf16"])
    assert not {"mul", "relu", "batch_norm", "dropout"} & set(got["bf16"])
    x = torch.randn(4, 4) * 1e3
    assert (x * 100).dtype == FP32 and torch.mm(x, x).dtype == FP16


def test_gradscaler_training_under_float16_matches_autocast():
    def train(ctx):
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 1)
        x = torch.randn(64, 4)
        y = x @ torch.tensor([[1.2e5], [8e4], [4e4], [2e4]]) + 5e5
        mean, std = y.mean(0), y.std(0)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu")
        skipped = 0
        for _ in range(10):
            with ctx():
                loss = ((net(x) * std + mean - y) / std).pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < scale
        return skipped

    autocast = train(lambda: torch.autocast("cpu", dtype=FP16))
    mixed = train(lambda: hmp.converted(low_precision_type=FP16))
    assert mixed <= autocast + 1 and mixed < 5


# -- advice that works ----------------------------------------------------------------------------


def test_notes_suggest_the_extending_form(monkeypatch):
    monkeypatch.setattr(lists, "fallback_names", lambda low: ())  # an op the fallback lists do not cover
    hmp.convert()
    bias, a = torch.randn(2, 2), torch.randn(1, 2, 2).bfloat16()
    with pytest.raises(RuntimeError) as e:
        torch.addbmm(bias, a, a)
    hmp.diagnostics.errors.annotate(e.value)
    note = "\n".join(getattr(e.value, "__notes__", []))
    if not note:
        pytest.skip("this Python adds no exception notes")
    assert "addbmm" in note and "include default" in note and "bf16_file_path" in note


# -- tensor subclasses that refuse a cast ------------------------------------------------------------


def test_a_tensor_subclass_that_refuses_a_cast_runs_uncast():
    from torch.masked import masked_tensor

    data, mask = torch.randn(3, 4), torch.rand(3, 4) > 0.3
    with hmp.converted():
        mt = masked_tensor(data, mask)
        for out in (mt * 2.0, torch.mul(mt, 3.0), mt + mt):
            assert out.get_data().dtype == FP32

    class Stubborn(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.bfloat16, torch._C.TensorBase.bfloat16, torch.Tensor.half):
                raise TypeError("Stubborn stays float32")
            return super().__torch_function__(func, types, args, kwargs or {})

    s = torch.randn(3).as_subclass(Stubborn)
    with hmp.converted():
        out = torch.relu(s) * torch.ones(3)
    assert out.dtype == FP32


def test_the_default_lists_load_where_a_library_they_name_is_blocked():
    """A program that blocks a library (``sys.modules["diffusers"] = None``, a common way to stub one
    out) converts with the default lists: their diffusers entries stay patterns, nothing imported."""
    code = (
        "import sys; sys.modules['diffusers'] = None\n"
        "import hmp\n"
        "hmp.convert(); print(sorted(n for n in hmp.effective_lists()['fp32'] if n.startswith('diffusers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "diffusers.models.embeddings.Timesteps" in out.stdout
