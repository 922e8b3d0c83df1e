"""RNN kernels in the lists: nn.LSTM, nn.GRU, nn.RNN and their cells run in
the listed dtype, input, hidden state and weights alike."""

import sys

import pytest
import torch
import torch.nn as nn
from helpers import skip_without_bf16_lstm, write
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import hmp
from hmp.binding.resolve import RNN_KERNELS
from hmp.diagnostics import errors

MODULES = {
    "lstm": lambda: nn.LSTM(8, 6, num_layers=2),
    "gru": lambda: nn.GRU(8, 6, num_layers=2),
    "rnn_tanh": lambda: nn.RNN(8, 6, num_layers=2),
    "rnn_relu": lambda: nn.RNN(8, 6, num_layers=2, nonlinearity="relu"),
}
CELLS = {
    "lstm_cell": lambda: nn.LSTMCell(8, 6),
    "gru_cell": lambda: nn.GRUCell(8, 6),
    "rnn_tanh_cell": lambda: nn.RNNCell(8, 6),
    "rnn_relu_cell": lambda: nn.RNNCell(8, 6, nonlinearity="relu"),
}
DTYPE = {"bf16": torch.bfloat16, "fp32": torch.float32}


def convert_with(tmp_path, kind, names):
    """Lists holding only ``names`` in ``kind`` (the other lists empty)."""
    files = {
        k: write(tmp_path, f"{k}.txt", "\n".join(names) + "\n" if k == kind else "\n")
        for k in ("bf16", "fp32", "promote")
    }
    hmp.convert(bf16_file_path=files["bf16"], fp32_file_path=files["fp32"], promote_file_path=files["promote"])


def converted(tmp_path, kind, name, table=MODULES):
    """``name`` alone listed in ``kind``, and its module built from seed 0."""
    convert_with(tmp_path, kind, [name])
    torch.manual_seed(0)
    return table[name]()


def reference(make, dtype, *inputs):
    """The oracle: a copy of the module converted to ``dtype`` by hand, fed
    inputs in ``dtype``, outside hmp."""
    torch.manual_seed(0)
    module = make().to(dtype)
    cast = [
        x.to(dtype) if isinstance(x, (torch.Tensor, PackedSequence)) else tuple(h.to(dtype) for h in x) for x in inputs
    ]
    with hmp.disable_casts():
        return module(*cast)


def flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for x in out for t in flat(x)]


@pytest.mark.parametrize("kind", ["bf16", "fp32"])
@pytest.mark.parametrize("name", sorted(MODULES))
def test_listed_rnn_runs_in_its_list_dtype(tmp_path, name, kind):
    if name == "lstm" and kind == "bf16":
        skip_without_bf16_lstm()
    module = converted(tmp_path, kind, name)
    x = torch.randn(5, 3, 8).bfloat16()  # what a bf16-listed dropout before the RNN hands it
    out = module(x)
    dtype = DTYPE[kind]
    assert all(t.dtype == dtype for t in flat(out))
    expected = reference(MODULES[name], dtype, x)
    for got, want in zip(flat(out), flat(expected)):
        assert torch.equal(got, want)
    flat(out)[0].float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in module.parameters())


@pytest.mark.parametrize("kind", ["bf16", "fp32"])
def test_given_hidden_state_is_cast_too(tmp_path, kind):
    if kind == "bf16":
        skip_without_bf16_lstm()
    module = converted(tmp_path, kind, "lstm")
    x = torch.randn(5, 3, 8).bfloat16()
    hx = (torch.randn(2, 3, 6), torch.randn(2, 3, 6))  # fp32, the input bf16
    out, (h, c) = module(x, hx)
    dtype = DTYPE[kind]
    assert out.dtype == h.dtype == c.dtype == dtype
    want, (wh, wc) = reference(MODULES["lstm"], dtype, x, hx)
    assert torch.equal(out, want) and torch.equal(h, wh) and torch.equal(c, wc)


@pytest.mark.parametrize("kind", ["bf16", "fp32"])
@pytest.mark.parametrize("name", ["lstm", "gru"])
def test_packed_sequence(tmp_path, name, kind):
    module = converted(tmp_path, kind, name)
    packed = pack_padded_sequence(torch.randn(5, 3, 8).bfloat16(), torch.tensor([5, 4, 2]))
    out, _ = module(packed)
    assert out.data.dtype == DTYPE[kind]
    want, _ = reference(MODULES[name], DTYPE[kind], packed)
    assert torch.equal(out.data, want.data) and torch.equal(out.batch_sizes, want.batch_sizes)


@pytest.mark.parametrize("kind", ["bf16", "fp32"])
@pytest.mark.parametrize("name", sorted(CELLS))
def test_cells(tmp_path, name, kind):
    cell = converted(tmp_path, kind, name, CELLS)
    x = torch.randn(3, 8).bfloat16()
    hx = torch.randn(3, 6)  # fp32 hidden state beside a bf16 input
    hx = (hx, torch.randn(3, 6)) if name == "lstm_cell" else hx
    out = cell(x, hx)
    dtype = DTYPE[kind]
    assert all(t.dtype == dtype for t in flat(out))
    for got, want in zip(flat(out), flat(reference(CELLS[name], dtype, x, hx))):
        assert torch.equal(got, want)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("name", sorted(MODULES) + sorted(CELLS))
def test_default_lists_run_a_bf16_input(name, opt_level):
    if name == "lstm":
        skip_without_bf16_lstm()
    hmp.convert(opt_level)
    assert any(name in names for names in hmp.effective_lists().values())
    torch.manual_seed(0)
    module = {**MODULES, **CELLS}[name]()
    x = torch.randn(5, 3, 8).bfloat16()
    out = module(x if name in MODULES else x[0])  # raised ValueError before the RNN kernels were bound
    flat(out)[0].float().sum().backward()


def test_word_language_model_shape_runs_under_o1():
    """pytorch/examples word_language_model: dropout (BF16 list) before nn.LSTM."""
    skip_without_bf16_lstm()
    hmp.convert("O1")
    torch.manual_seed(0)
    emb, drop, lstm, dec = nn.Embedding(20, 8), nn.Dropout(0.2), nn.LSTM(8, 8, 2, dropout=0.2), nn.Linear(8, 20)
    tokens = torch.randint(0, 20, (6, 2))
    out, _ = lstm(drop(emb(tokens)))
    loss = nn.functional.cross_entropy(dec(drop(out)).view(-1, 20), tokens.view(-1))
    loss.backward()
    assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert lstm.weight_ih_l0.grad.dtype == torch.float32


def test_revert_restores_vf_and_the_check_exactly(pristine):
    vf, check = torch._VF, nn.RNNBase.__dict__["check_input"]
    hmp.convert("O1")
    assert set(RNN_KERNELS) <= set(vars(vf))  # bound on torch._VF itself
    assert nn.RNNBase.__dict__["check_input"] is not check
    hmp.revert()
    assert not set(RNN_KERNELS) & set(vars(vf))  # added attributes are deleted again
    assert nn.RNNBase.__dict__["check_input"] is check
    assert vf.lstm is torch._C._VariableFunctions.lstm


def test_disable_casts_keeps_the_module_check():
    """Casts off: torch's own dtype check; casts on: its shape checks still run."""
    hmp.convert("O1")
    lstm = nn.LSTM(4, 4)
    with hmp.disable_casts():
        # torch's wording: 2.4 "input must have the type", later "does not match weight dtype"
        with pytest.raises(ValueError, match="does not match weight dtype|input must have the type"):
            lstm(torch.randn(1, 2, 4).bfloat16())
    with pytest.raises(RuntimeError, match="input.size"):
        lstm(torch.randn(1, 2, 5).bfloat16())


def uncaught_note(fn):
    """The note errors.explain gives an error that passed through nothing hmp
    notes (what ``python -m hmp run`` adds to a script's uncaught error; a plain
    ``python script.py`` prints none: hmp replaces no exception hook)."""
    with pytest.raises(Exception) as info:
        fn()
    e = info.value
    assert not [n for n in getattr(e, "__notes__", ()) if n.startswith("hmp: ")]
    note = errors.explain(e)
    assert [n for n in getattr(e, "__notes__", ()) if n.startswith("hmp: ")] == [note]
    return note


needs_notes = pytest.mark.skipif(sys.version_info < (3, 11), reason="add_note is Python 3.11+")


@needs_notes
def test_note_for_an_unlisted_rnn_names_its_kernel(tmp_path):
    convert_with(tmp_path, "bf16", ["linear"])
    lstm = nn.LSTM(4, 4)
    note = uncaught_note(lambda: lstm(torch.randn(1, 2, 4).bfloat16()))
    assert "LSTM checks in Python" in note and "'lstm' is in no hmp list" in note
    assert "missing from hmp's lists" not in note


@needs_notes
def test_note_for_a_listed_rnn_run_with_casts_off():
    hmp.convert("O1")
    gru = nn.GRU(4, 4)
    with hmp.disable_casts():
        note = uncaught_note(lambda: gru(torch.randn(1, 2, 4).bfloat16()))
    assert "'gru' is in the BF16 list" in note and "casts off" in note


@needs_notes
def test_note_for_a_python_dtype_check_of_a_user_module():
    hmp.convert("O1")

    def forward(x):
        if x.dtype != torch.float32:
            raise TypeError(f"expected float32, got {x.dtype}")
        return x

    note = uncaught_note(lambda: forward(torch.ones(2).bfloat16()))
    assert "forward" in note and "checked dtypes itself" in note and "missing from hmp's lists" not in note
