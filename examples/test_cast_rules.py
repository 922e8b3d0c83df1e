"""Test your own cast rules in CI: copy this file into your tests and point MY_BF16 at your list file.

    python -m pytest examples/test_cast_rules.py      (or: python examples/test_cast_rules.py)

It needs pytest and hypothesis (pip install pytest hypothesis, or the testing extra). hmp's pytest plugin comes with hmp
(no conftest needed): ``@pytest.mark.hmp(...)`` runs a test under ``hmp.convert(...)`` with those
arguments and puts everything back when the test returns; the ``hmp_converted`` fixture does the
same for a test that names it. What it checks (docs/testing.md):

- every op of your lists, called on drawn inputs (edge values among them), runs in the dtype
  hmp's rules give, never fails where plain torch runs, and never sees a finite value as inf;
  an entry without sample calls fails (it would never be checked);
- a model's listed ops run in the dtypes you mean (``assert_runs_as``);
- after a converted test, the next one runs unconverted.
"""

import sys
import tempfile
from pathlib import Path

try:
    import pytest
    from hypothesis import given, settings
except ImportError as e:
    raise ImportError(
        "this example is a pytest file that draws calls with hypothesis: pip install pytest hypothesis"
    ) from e

import torch
import torch.nn as nn

import hmp
from hmp.testing import assert_follows_rules, assert_runs_as, expected_dtype
from hmp.testing import strategies as hst

# Your BF16 list file. Here: the default list plus softmax, which moves softmax out of the default
# FP32 list. In your repo, name the file itself (a relative path is read from this file's folder).
_FOLDER = tempfile.TemporaryDirectory(prefix="hmp-lists-")  # removed when the process ends
MY_BF16 = Path(_FOLDER.name) / "my_bf16.txt"
MY_BF16.write_text("include default\nsoftmax\n")


@pytest.mark.hmp(bf16_file_path=str(MY_BF16))
@settings(max_examples=30, deadline=None)
@given(hst.listed_calls(edges=True))
def test_every_listed_op_follows_the_rules(call):
    """Any entry of the lists in force, drawn calls of it: hmp runs each as its rules say."""
    op, args, kwargs = call
    assert_follows_rules(op, *args, **kwargs)


@pytest.mark.hmp(bf16_file_path=str(MY_BF16))
def test_every_listed_op_is_exercised():
    """An entry no drawn call reaches (no sample calls) is never checked: name it here."""
    assert hst.without_calls() == {}


@pytest.mark.hmp(bf16_file_path=str(MY_BF16))
def test_softmax_now_runs_in_bf16():
    x = torch.randn(4, 8)
    assert expected_dtype(torch.softmax, x, -1) == torch.bfloat16
    assert expected_dtype(torch.log_softmax, x, -1) == torch.float32  # still the FP32 list's
    assert expected_dtype(torch.add, x, x) is None  # left to torch: its promotion decides


@pytest.mark.hmp(bf16_file_path=str(MY_BF16))
def test_the_model_runs_as_meant():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4), nn.Softmax(-1))
    out = assert_runs_as(
        model,
        torch.randn(2, 8),
        expect={"linear": torch.bfloat16, "gelu": torch.bfloat16, "softmax": torch.bfloat16},
    )
    assert out.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the weights stay float32


def test_default_lists(hmp_converted):
    """The fixture alone: hmp.convert() with its defaults; it yields what each entry does."""
    assert hmp_converted["bf16"]["mm"] == "cast"
    assert hmp_converted["fp32"]["softmax"] == "cast"
    x = torch.randn(3, 3)
    assert_runs_as(lambda: torch.softmax(x @ x, -1), expect={"matmul": torch.bfloat16, "softmax": torch.float32})


def test_the_next_test_runs_unconverted():
    assert not hmp.is_converted()
    assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32


if __name__ == "__main__":
    # this file imported hypothesis before pytest started: its assertion rewriting cannot apply to it
    sys.exit(
        pytest.main(
            [__file__, "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning", *sys.argv[1:]]
        )
    )
