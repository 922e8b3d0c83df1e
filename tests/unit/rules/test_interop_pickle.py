"""Pickling while converted: stock modules hold torch functions (an
nn.TransformerEncoderLayer holds F.relu from its default argument)."""

import copy
import inspect
import io
import multiprocessing.reduction
import os
import pickle
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hmp

PLAIN = {"pickle.Pickler": pickle.Pickler, "pickle.dump": pickle.dump, "pickle.dumps": pickle.dumps}


def layer(**kwargs):
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, **kwargs)


def test_torch_save_and_pickle_while_converted(tmp_path):
    """pickle itself is left alone: torch.save saves the original a model
    captured before convert() by name; pickle.dumps cannot (pickle's own check,
    docs/leaves-alone.md), but saves the wrapper a model captured while converted."""
    before = layer()  # holds the original F.relu
    hmp.convert(strict=True)  # F.relu is wrapped under Habana's literal rule only
    default = layer()  # its default argument is the original too, bound when torch was imported
    during = layer(activation="relu")  # looks F.relu up now: the wrapper
    assert PLAIN == {"pickle.Pickler": pickle.Pickler, "pickle.dump": pickle.dump, "pickle.dumps": pickle.dumps}
    assert F.relu is not before.activation and default.activation is before.activation
    assert F.relu is during.activation  # the name now finds hmp's wrapper
    assert inspect.signature(torch.save) == inspect.signature(torch.serialization.save.__wrapped__)
    for m in (before, default, during):
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert loaded.activation is F.relu  # a name, looked up when loading: here the wrapper
        twin = copy.deepcopy(m)  # functions are copied by reference
        assert twin.activation is m.activation
    assert pickle.loads(pickle.dumps(during)).activation is F.relu
    for m in (before, default):
        with pytest.raises(pickle.PicklingError, match="not the same object as torch.nn.functional.relu"):
            pickle.dumps(m)
    legacy = io.BytesIO()  # the old format calls pickle_module.dump too
    torch.save(before, legacy, _use_new_zipfile_serialization=False)
    assert torch.load(io.BytesIO(legacy.getvalue()), weights_only=False).activation is F.relu
    with pytest.raises(pickle.PicklingError):  # a pickle_module the caller chose is used as given
        torch.save(before, io.BytesIO(), pickle_module=types.SimpleNamespace(__name__="mine", Pickler=pickle.Pickler))
    torch.save(before, tmp_path / "model.pt")
    hmp.revert()
    assert torch.save is torch.serialization.save and not hasattr(torch.save, "__wrapped__")
    assert "reducer_override" not in vars(multiprocessing.reduction.ForkingPickler)
    # a process without hmp loads the original functions
    code = textwrap.dedent(f"""
        import sys, torch, torch.nn.functional as F
        m = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
        assert m.activation is F.relu, m.activation
        assert "hmp" not in sys.modules
        print(m(torch.randn(2, 3, 8)).dtype)
    """)
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=""),
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "torch.float32" in r.stdout, r.stderr[-2000:]


def test_wrapper_captured_while_converted_fails_after_revert_with_hmp_saying_why():
    """By construction: pickle saves a function by name, and after revert()
    the name finds the original, not the (retired) wrapper a module captured."""
    hmp.convert(strict=True)  # F.relu is wrapped under Habana's literal rule only
    m = nn.Module()
    m.act = F.relu
    hmp.revert()
    assert m.act(torch.tensor([-1.0])).item() == 0.0
    with pytest.raises(pickle.PicklingError, match=r"hmp wrapper retired by revert\(\): pickle the state_dict"):
        pickle.dumps(m)


class Activations(torch.utils.data.Dataset):
    def __init__(self):
        self.fn = F.relu  # captured before convert(): the original

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return self.fn(torch.tensor([i - 1.0]))


def test_spawn_dataloader_while_converted(one_intra_op_thread):
    ds = Activations()
    hmp.convert()
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=1, multiprocessing_context="spawn")
    (batch,) = list(loader)
    assert batch.flatten().tolist() == [0.0, 0.0]
