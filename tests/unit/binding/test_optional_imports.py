"""An optional package (torchvision) that is a stub, has no spec or fails to
import never makes convert() fail; hmp warns once per process, one prefix."""

import importlib.machinery
import logging
import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import release_said

import hmp
from hmp.core import state


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not warned yet, and no real torchvision in the way."""
    monkeypatch.setattr(state, "warned", release_said())
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        monkeypatch.delitem(sys.modules, name)
    return monkeypatch


def stub_without_spec(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torchvision", types.ModuleType("torchvision"))  # __spec__ is None


def stub_module_not_package(monkeypatch, tmp_path):
    stub = types.ModuleType("torchvision")
    stub.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)  # a spec, but no torchvision.ops
    monkeypatch.setitem(sys.modules, "torchvision", stub)


def package_that_fails(monkeypatch, tmp_path):
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text("raise ImportError('built for another torch')\n")
    monkeypatch.syspath_prepend(str(tmp_path))


CASES = {"no spec": stub_without_spec, "not a package": stub_module_not_package, "import error": package_that_fails}


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_torchvision_never_fails_convert(fresh, tmp_path, caplog, case):
    CASES[case](fresh, tmp_path)
    with caplog.at_level(logging.DEBUG, logger="hmp"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hmp.convert("O1")
        assert F.linear(torch.randn(2, 3), torch.randn(4, 3)).dtype == torch.bfloat16
        hmp.revert()
        hmp.convert("O2")  # and again: no second warning
    ours = [str(w.message) for w in caught if "torchvision" in str(w.message)]
    assert len(ours) == 1, ours
    assert ours[0].startswith("hmp: torchvision.ops ") and ours[0].count("hmp:") == 1
    assert not [r for r in caplog.records if "torchvision" in r.getMessage()]  # not logged as well


def test_warnings_as_errors_still_convert(fresh, tmp_path):
    stub_without_spec(fresh, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hmp.convert("O1")
    assert hmp.is_converted()
