"""hmp.convert_from_config: optimum-habana's gaudi_config.json."""

import json
import logging
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same, snapshot

import hmp
from hmp.binding.lists import list_dir

BERT = list_dir() / "gaudi_config_bert.json"
BERT_AUTOCAST = list_dir() / "gaudi_config_bert_autocast.json"
BERT_BF16 = [
    "add",
    "addmm",
    "bmm",
    "div",
    "dropout",
    "gelu",
    "iadd",
    "layer_norm",
    "linear",
    "matmul",
    "mm",
    "rsub",
    "softmax",
    "truediv",
]
BERT_FP32 = ["embedding", "log_softmax", "nll_loss"]


def hmp_config(**fields):
    return {"use_habana_mixed_precision": True, **fields}


def test_shipped_bert_config(pristine):
    assert hmp.convert_from_config(BERT) is True
    lists = hmp.effective_lists()
    # iadd is Habana's name for `a += b`: it binds Tensor.__iadd__, in place
    assert lists["bf16"] == BERT_BF16
    assert lists["fp32"] == BERT_FP32
    assert not set(lists["promote"]) & set(BERT_BF16 + BERT_FP32)


def test_bert_config_runs_a_bert_like_block(pristine):
    hmp.convert_from_config(BERT)
    torch.manual_seed(0)
    vocab, dim = 50, 16
    emb = torch.nn.Embedding(vocab, dim)
    norm = torch.nn.LayerNorm(dim)
    proj = torch.nn.Linear(dim, vocab)
    ids = torch.randint(0, vocab, (4, 6))
    h = emb(ids)
    assert h.dtype == torch.float32  # embedding: FP32 list
    h = norm(h)
    assert h.dtype == torch.float32  # layer_norm: in the config's BF16 list, cast only under strict (pays.py)
    scores = torch.matmul(h, h.transpose(-1, -2)) / 4.0
    assert scores.dtype == torch.bfloat16  # matmul, truediv: BF16 list
    attn = F.softmax(scores, dim=-1)
    assert attn.dtype == torch.bfloat16  # softmax: BF16 in this config (FP32 by default)
    h = F.gelu(proj(attn @ h))
    assert h.dtype == torch.bfloat16
    logp = F.log_softmax(h, dim=-1)
    assert logp.dtype == torch.float32
    loss = F.nll_loss(logp.reshape(-1, vocab), ids.reshape(-1))
    assert loss.dtype == torch.float32
    loss.backward()
    assert proj.weight.grad.dtype == torch.float32 and emb.weight.grad.dtype == torch.float32


def test_iadd_in_a_list_keeps_plus_equal_in_place(pristine):
    hmp.convert_from_config(BERT)
    a = torch.ones(3)
    alias = a
    a += torch.ones(3, dtype=torch.bfloat16)
    assert a is alias and a.dtype == torch.float32
    assert torch.equal(alias, torch.full((3,), 2.0))


def test_autocast_form_maps_onto_the_same_lists(pristine):
    assert hmp.convert_from_config(BERT_AUTOCAST) is True
    assert hmp.effective_lists()["bf16"] == BERT_BF16
    assert hmp.effective_lists()["fp32"] == BERT_FP32


def test_mapping_and_pathlike_and_str(tmp_path, pristine):
    config = hmp_config(hmp_bf16_ops=["linear"], hmp_fp32_ops=["softmax"])
    path = tmp_path / "gaudi_config.json"
    path.write_text(json.dumps(config))
    for given in (config, path, str(path)):
        hmp.revert()
        assert hmp.convert_from_config(given) is True
        assert hmp.effective_lists()["bf16"] == ["linear"]
        assert hmp.effective_lists()["fp32"] == ["softmax"]


def test_missing_hmp_lists_are_optimum_habanas_bert_lists(pristine, monkeypatch):
    """optimum-habana's GaudiConfig fills missing hmp_*_ops with its BERT lists
    (run as on HPU: HMP_STRICT=1, Habana's literal rule, casts pointwise ops too)."""
    monkeypatch.setenv("HMP_STRICT", "1")
    hmp.convert_from_config({"use_habana_mixed_precision": True})
    lists = hmp.effective_lists()
    assert lists["bf16"] == BERT_BF16 and lists["fp32"] == BERT_FP32
    x = torch.randn(2, 3)
    assert (x / 2).dtype == torch.bfloat16 and torch.div(x, 2).dtype == torch.bfloat16  # truediv, div: BF16
    assert F.softmax(x, dim=-1).dtype == torch.bfloat16  # FP32 in hmp's own default lists


def test_missing_autocast_lists_are_hmps_defaults(pristine):
    hmp.convert_from_config({"use_torch_autocast": True})
    defaults = hmp.effective_lists()
    hmp.revert()
    hmp.convert()
    assert hmp.effective_lists() == defaults


def test_one_list_given_wins_over_the_other_default(pristine):
    hmp.convert_from_config(hmp_config(hmp_bf16_ops=["log_softmax", "linear"]))
    lists = hmp.effective_lists()
    assert lists["bf16"] == ["linear", "log_softmax"]
    assert lists["fp32"] == ["embedding", "nll_loss"]  # BERT's FP32 list less what the BF16 list takes
    hmp.revert()
    hmp.convert_from_config(hmp_config(hmp_fp32_ops=["softmax"]))
    assert hmp.effective_lists()["fp32"] == ["softmax"]
    assert hmp.effective_lists()["bf16"] == [n for n in BERT_BF16 if n != "softmax"]


def test_opt_level_o2(pristine):
    hmp.convert_from_config(hmp_config(hmp_opt_level="O2"))
    lists = hmp.effective_lists()
    hmp.revert()
    hmp.convert(opt_level="O2")
    assert hmp.effective_lists() == lists


def test_verbose(caplog, pristine):
    with caplog.at_level(logging.INFO, logger="hmp"):
        hmp.convert_from_config(hmp_config(hmp_bf16_ops=["linear"], hmp_is_verbose=True))
    assert any("bf16 list, cast: linear" in r.getMessage() for r in caplog.records)


def test_low_precision_type(pristine):
    hmp.convert_from_config(hmp_config(hmp_bf16_ops=["linear"]), low_precision_type=torch.float16)
    assert F.linear(torch.randn(2, 3), torch.randn(4, 3)).dtype == torch.float16


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"use_habana_mixed_precision": False},
        {"use_torch_autocast": False},
        {"use_habana_mixed_precision": False, "use_torch_autocast": False, "hmp_bf16_ops": ["linear"]},
    ],
)
def test_no_mixed_precision_reverts_and_returns_false(config, pristine):
    hmp.convert()
    assert hmp.convert_from_config(config) is False
    assert not hmp.is_converted()


def test_both_modes_is_an_error(pristine):
    with pytest.raises(ValueError, match="use_habana_mixed_precision and use_torch_autocast are both true"):
        hmp.convert_from_config({"use_habana_mixed_precision": True, "use_torch_autocast": True})


def test_unrelated_fields_are_ignored_with_a_debug_log(caplog, pristine):
    config = hmp_config(
        use_fused_adam=True,
        use_fused_clip_norm=True,
        use_dynamic_shapes=False,
        hmp_bf16_ops=["linear"],
        autocast_bf16_ops=["not even checked"],
    )
    with caplog.at_level(logging.DEBUG, logger="hmp"):
        assert hmp.convert_from_config(config) is True
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    for field in ("use_fused_adam", "use_fused_clip_norm", "use_dynamic_shapes", "autocast_bf16_ops"):
        assert any(field in m for m in debug), field


@pytest.mark.parametrize(
    "field, value",
    [
        ("use_habana_mixed_precision", "yes"),
        ("use_habana_mixed_precision", 1),
        ("hmp_is_verbose", "false"),
        ("hmp_opt_level", "O3"),
        ("hmp_opt_level", 1),
        ("hmp_bf16_ops", "linear"),
        ("hmp_fp32_ops", {"softmax": 1}),
    ],
)
def test_wrong_type_names_the_field(field, value, pristine):
    config = hmp_config(**{field: value})
    with pytest.raises(ValueError, match=field):
        hmp.convert_from_config(config)
    assert not hmp.is_converted()


def test_autocast_wrong_type_names_the_field(pristine):
    with pytest.raises(ValueError, match="autocast_fp32_ops"):
        hmp.convert_from_config({"use_torch_autocast": True, "autocast_fp32_ops": "softmax"})


def test_unknown_op_names_field_and_position(pristine):
    hmp.convert()
    before = hmp.effective_lists()
    config = hmp_config(hmp_bf16_ops=["linear", "matmul", "mm", "sofmax"], hmp_fp32_ops=["embedding", 7, "a-b"])
    with pytest.raises(ValueError) as info:
        hmp.convert_from_config(config)
    text = str(info.value)
    assert "hmp_bf16_ops[3]: unknown op 'sofmax'; did you mean softmax" in text
    assert "hmp_fp32_ops[1]: 7 is not an op name" in text
    assert "hmp_fp32_ops[2]: 'a-b' is not an op name" in text
    assert hmp.effective_lists() == before  # a failed call changes nothing


def test_autocast_unknown_op_names_its_field(pristine):
    with pytest.raises(ValueError, match=r"autocast_bf16_ops\[0\]: unknown op 'linaer'"):
        hmp.convert_from_config({"use_torch_autocast": True, "autocast_bf16_ops": ["linaer"]})


def test_op_in_both_lists(pristine):
    with pytest.raises(ValueError, match="ops in both hmp_bf16_ops and hmp_fp32_ops: linear"):
        hmp.convert_from_config(hmp_config(hmp_bf16_ops=["linear", "mm"], hmp_fp32_ops=["linear"]))


def test_inplace_operator_name_alone_binds_the_operator(pristine):
    hmp.convert_from_config(hmp_config(hmp_bf16_ops=["linear", "iadd"]))
    assert "iadd" in hmp.effective_lists()["bf16"]
    a = torch.zeros(2)
    a += torch.ones(2, dtype=torch.bfloat16)
    assert a.dtype == torch.float32 and torch.equal(a, torch.ones(2))


def test_bad_files(tmp_path, pristine):
    with pytest.raises(OSError, match="missing.json"):
        hmp.convert_from_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(ValueError, match="bad.json.*not valid JSON"):
        hmp.convert_from_config(bad)
    top = tmp_path / "list.json"
    top.write_text('["linear"]')
    with pytest.raises(ValueError, match="JSON object"):
        hmp.convert_from_config(top)
    with pytest.raises(TypeError):
        hmp.convert_from_config(42)


def test_temporary_list_files_are_removed(tmp_path, monkeypatch, pristine):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    hmp.convert_from_config(BERT)
    assert hmp.is_converted()
    assert list(Path(tmp_path).iterdir()) == []


def test_module_fields(pristine):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    config = {"use_habana_mixed_precision": True, "hmp_fp32_modules": ["1"], "hmp_bf16_modules": ["torch.nn.GRU"]}
    assert hmp.convert_from_config(config, model=model)
    assert model(torch.randn(2, 4)).dtype == torch.float32  # the LayerNorm ran under the FP32 module rule
    gru = torch.nn.GRU(4, 4)
    assert gru(torch.randn(3, 2, 4))[0].dtype == torch.bfloat16
    hmp.revert()
    with pytest.raises(ValueError, match=r"gaudi config \(mapping\):\n  hmp_fp32_modules\[0\]: '9' matches no module"):
        hmp.convert_from_config(dict(config, hmp_fp32_modules=["9"]), model=model)
    with pytest.raises(ValueError, match=r"hmp_bf16_modules: must be a list of module class import paths"):
        hmp.convert_from_config(dict(config, hmp_bf16_modules="torch.nn.LSTM"))
    assert_same(pristine, snapshot())
