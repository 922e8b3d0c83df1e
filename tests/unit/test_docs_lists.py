"""docs/lists.md's table of the default lists says what the shipped files hold: each row's entries
are its file's lines (ops, ``include`` lines and module entries), and the table has a row for every
file any list kind takes as its default, so neither can change without the other."""

import re
from pathlib import Path

import pytest
import torch

from hmp.binding import kinds
from hmp.binding.list_files import list_path, read_names

DOC = Path(__file__).resolve().parents[2] / "docs" / "lists.md"
MARKER = "<!-- default lists table: tests/unit/test_docs_lists.py compares it with op_lists/ -->"


def table_rows(text=None):
    """``{file name: (ops count as written, [entries as written])}`` from the table after MARKER."""
    lines = (DOC.read_text(encoding="utf-8") if text is None else text).splitlines()
    at = lines.index(MARKER)
    header, rule, *body = lines[at + 1 :]
    assert header.startswith("| list | file | ops | entries |") and rule.startswith("|---")
    rows = {}
    for line in body:
        if not line.startswith("|"):
            break
        _, _title, file, count, entries, _ = (cell.strip() for cell in line.split("|"))
        name = re.fullmatch(r"`(\w+\.txt)`", file).group(1)
        rows[name] = (int(count), [e.strip().strip("`") for e in entries.split(",")])
    return rows


def file_entries(name):
    """What a shipped list file holds, written as the table writes it."""
    out = []
    for line in read_names(list_path(name.removesuffix(".txt"))):
        assert not line.remove, f"{name} line {line.number}: a shipped default takes nothing out"
        out.append(f"include {line.name}" if line.include else line.name)
    return out


def default_files():
    """Every file a list kind reads as its default, under each opt_level, lower dtype and strict."""
    found = set()
    for k in kinds.KINDS:
        for level in kinds.OPT_LEVELS:
            for low in (torch.bfloat16, torch.float16):
                for strict in (False, True):
                    found.add(k.default_file(level, low, strict))
    return found


def test_the_table_has_a_row_for_every_default_file():
    assert set(table_rows()) == default_files()


@pytest.mark.parametrize("name", sorted(default_files()))
def test_each_row_is_its_file(name):
    count, entries = table_rows()[name]
    held = file_entries(name)
    assert sorted(entries) == sorted(held), (
        f"docs/lists.md's row for {name}: missing {sorted(set(held) - set(entries))}, "
        f"not in the file {sorted(set(entries) - set(held))}"
    )
    ops = [e for e in held if not e.startswith("include ") and "." not in e]
    assert count == len(ops), f"docs/lists.md says {name} holds {count} ops; it holds {len(ops)}"


def test_a_row_that_falls_behind_its_file_is_caught():
    text = DOC.read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| FP32 | `fp32.txt` |"))
    stale = text.replace(row, row.replace(", cdist", ""))
    count, entries = table_rows(stale)["fp32.txt"]
    assert "cdist" not in entries and sorted(entries) != sorted(file_entries("fp32.txt"))
