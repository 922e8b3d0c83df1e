"""The binding rule ("``X`` binds ``X_``, ``__X__``, ``__rX__``, ``__iX__``") is spelled once
(resolve.entry_forms, with its inverse resolve.list_names, which the error note uses), and the
testing kit's oracle, which derives the names of an attribute on its own, agrees with it on every
attribute of torch.Tensor and torch."""

import pytest
import torch

from hmp.binding.resolve import Resolver, entry_forms, list_names
from hmp.testing import entries

RESOLVER = Resolver()
ATTRS = sorted(
    {a for a in dir(torch.Tensor) if callable(getattr(torch.Tensor, a, None))}
    | {a for a in dir(torch) if callable(getattr(torch, a, None)) and not a[:1].isupper()}
)


def _has(attr):
    return attr in vars(torch.Tensor) or hasattr(torch.Tensor, attr)


def _binds(name, attr):
    plain, on_tensor = entry_forms(name, _has)
    return attr in {a for a, _ in plain + on_tensor}


def test_each_name_an_attribute_gives_binds_it():
    """list_names inverts entry_forms: every existing list name it gives for an attribute binds it."""
    wrong = [
        (attr, name) for attr in ATTRS for name in list_names(attr) if RESOLVER.exists(name) and not _binds(name, attr)
    ]
    # a dunder with no plain form (``__rshift__``'s "rshift" binds it, "shift" does not exist) is fine
    assert [w for w in wrong if not w[0].startswith("__")] == []


@pytest.mark.parametrize(
    "attr, names",
    [("__rmul__", ("rmul", "mul")), ("__iadd__", ("iadd", "add")), ("mul_", ("mul", "mul_")), ("mm", ("mm",))],
)
def test_list_names_of_each_form(attr, names):
    assert list_names(attr) == names


def test_entry_forms_of_an_operator_and_habanas_iadd():
    plain, on_tensor = entry_forms("mul", _has)
    assert plain == [("mul", False), ("mul_", True)]
    assert {a for a, _ in on_tensor} == {"mul", "mul_", "__mul__", "__rmul__", "__imul__"}
    assert ("__imul__", True) in on_tensor
    _, habana = entry_forms("iadd", _has)
    assert ("__iadd__", True) in habana and ("__add__", False) not in habana


def test_the_oracle_derives_the_same_names():
    """For every attribute, the list names that exist and bind it are the oracle's own answer's."""
    differ = []
    for attr in ATTRS:
        hmp_names = {n for n in list_names(attr) if RESOLVER.exists(n) and _binds(n, attr)}
        oracle = {n for n in entries._names(attr)[0] if RESOLVER.exists(n) and _binds(n, attr)}
        if hmp_names != oracle:
            differ.append((attr, sorted(hmp_names), sorted(oracle)))
    assert differ == []
