"""A new list kind is one record (issue 80 item 4): a toy fourth kind, added to kinds.KINDS
alone, is read, bound and shown by the real convert(); and every kind hmp ships has its
decorator and its command-line flag, so a kind added without them fails here."""

import argparse
import warnings

import pytest
import torch
from helpers import write

import hmp
from hmp.binding import kinds
from hmp.testing import expected_call, expected_dtype
from hmp.tools import arguments, inspect_cli

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.fixture
def half_kind(tmp_path, monkeypatch):
    """A fourth kind that convert() takes no parameter for: its ops run under the lower
    list's rule, and its file comes from its record's environment variable."""
    default = write(tmp_path, "half_default.txt", "")
    record = kinds.Kind(
        name="half",
        title="toy half",
        file_title="toy half list file",
        parameter="half_file_path",  # no such parameter of convert(): the record's environ names its file
        defaults={level: str(default) for level in kinds.OPT_LEVELS},
        policy=kinds.LOWER.policy,
        lean=kinds.LOWER.lean,
        environ=("HMP_TOY_HALF_LIST",),
        guards_defaults=False,
    )
    monkeypatch.setattr(kinds, "KINDS", kinds.KINDS + (record,))
    monkeypatch.setenv("HMP_TOY_HALF_LIST", str(write(tmp_path, "half.txt", "hypot\nlogaddexp\n")))
    return record


def test_convert_binds_and_shows_a_fourth_kind(half_kind):
    x = torch.rand(4, dtype=FP32)
    original = torch.hypot
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hmp.convert()
    try:
        assert torch.hypot is not original  # its op is wrapped
        assert torch.hypot(x, x).dtype == BF16  # and runs under its rule: float32 to the lower dtype
        assert torch.hypot(x, x, out=torch.empty(4)).dtype == FP32  # the full rule, as the lower list's
        # the testing kit's oracle reads the same record's fields and agrees
        assert expected_call(torch.hypot, x, x).rule == "half rule of hypot"
        assert expected_dtype(torch.hypot, x, x) == BF16
        shown = hmp.effective_lists()
        assert list(shown) == [*kinds.names()] and shown["half"] == ["hypot", "logaddexp"]
        # an op of the promote list given in a later kind's file is that kind's alone
        assert "hypot" not in shown["promote"] and "hypot" not in hmp.effective_lists(detail=True)["promote"]
        assert hmp.effective_lists(detail=True)["half"] == {"hypot": "cast", "logaddexp": "cast"}
    finally:
        hmp.revert()
    assert torch.hypot is original and torch.hypot(x, x).dtype == FP32


def test_the_command_line_takes_a_fourth_kinds_file(half_kind, tmp_path):
    parser = argparse.ArgumentParser()
    arguments.add_list_files(parser)
    args = parser.parse_args(["--fp32-file", "mine.txt"])
    assert args.half_file == ""  # its flag, from its record
    said = f"the toy half list {tmp_path / 'half.txt'} (from $HMP_TOY_HALF_LIST)"
    assert said in inspect_cli.lists_words(args)  # what the tools say they ran under


def test_every_kind_has_its_decorator_and_its_flag():
    parser = argparse.ArgumentParser()
    arguments.add_list_files(parser)
    flags = {a.option_strings[0]: a.dest for a in parser._actions if a.option_strings}
    for k in kinds.KINDS:
        assert callable(getattr(hmp, f"{k.name}_function")), k.name
        assert f"{k.name}_function" in hmp.__all__
        assert flags.get(f"--{k.name}-file") == f"{k.name}_file", k.name
        # and the tools pass the file it gives to convert()
        given = parser.parse_args([f"--{k.name}-file", "mine.txt"])
        assert inspect_cli.lists(given) == {k.parameter: "mine.txt"}
