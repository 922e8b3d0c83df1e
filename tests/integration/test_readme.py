"""README.md: its example runs as written and prints what README says it
prints; its links lead to files that exist; it stays short."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
EXAMPLE_MARKER = "<!-- readme example:"


def fenced_blocks_after(text, marker, count):
    """The first ``count`` fenced blocks after ``marker``, as (language, body)."""
    start = text.index(marker)
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", text[start:], flags=re.S | re.M)
    assert len(blocks) >= count, f"README: fewer than {count} fenced blocks after {marker!r}"
    return blocks[:count]


def test_example_runs_and_prints_what_readme_says(tmp_path):
    (lang, code), (out_lang, expected) = fenced_blocks_after(README, EXAMPLE_MARKER, 2)
    assert (lang, out_lang) == ("python", "text")
    script = tmp_path / "readme_example.py"
    script.write_text(code, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    # run from an empty directory so `import hmp` finds this checkout through PYTHONPATH only
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == expected.splitlines(), done.stdout


def test_example_is_about_fifteen_lines():
    ((_, code),) = fenced_blocks_after(README, EXAMPLE_MARKER, 1)
    assert len(code.splitlines()) <= 20


def test_readme_is_short():
    assert len(README.splitlines()) < 170


def anchors(markdown):
    """GitHub's anchors for the headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```$", "", markdown, flags=re.S | re.M), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_relative_links_lead_to_files_and_headings():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for doc in docs:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", doc.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            path = doc.parent / target if target else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
            elif anchor and anchor not in anchors(path.read_text(encoding="utf-8")):
                broken.append(f"{doc.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, broken


def test_ci_finds_the_test_command():
    """.ci/run extracts the block after the marker with awk; run that awk on README."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    program = re.search(r"cmd=\$\(awk '(.*)' README\.md\)", ci).group(1)
    done = subprocess.run(["awk", program, "README.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    ((_, body),) = fenced_blocks_after(README, "<!-- ci: test command -->", 1)
    assert done.stdout == body
    assert len(body.splitlines()) == 1 and "python -m pytest" in body


def test_tables_are_not_broken_by_blank_lines():
    """A row after a blank line starts a new table, which needs a header separator:
    a row cut off from its table renders as text."""
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = doc.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            starts_table = line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))
            if starts_table and not (i + 1 < len(lines) and re.match(r"^\|\s*:?-{3}", lines[i + 1])):
                broken.append(f"{doc.relative_to(ROOT)}:{i + 1}: {line[:60]}")
    assert not broken, broken


def test_ci_runs_readmes_test_command_in_a_folder_named_hmp():
    """.ci/run's leg 1 runs README's test command (every test, README's quick check among them) where a
    reader of README runs it: in a folder named hmp with its .venv inside. Command 1 installs and runs the
    demo, and the quick check is a pytest of tests/unit."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "readme_dir=$clone_tmp/hmp\n" in ci
    assert "\"cd '$readme_dir' && export PYTEST_ADDOPTS='--durations=40' && $cmd\"" in ci
    ((_, body),) = fenced_blocks_after(README, "<!-- ci: install command", 1)
    assert body.strip().endswith(" && python -m hmp demo")
    assert body.startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    found = re.findall(r"`pip install pytest [^`]*python -m pytest tests/unit`", README)
    assert found


def test_every_test_file_cis_legs_name_exists():
    """The legs after leg 1 run the files .ci/run names (TORCH_TESTS, MIDDLE_TESTS, the engine legs'): a
    renamed or moved test file must not silently leave a torch release untested (pytest would only say it
    found no such file once that leg ran)."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    named = set(re.findall(r"\btests/[\w/]+\.py\b", ci))
    assert len(named) > 30, named  # the lists are read
    assert sorted(p for p in named if not (ROOT / p).is_file()) == []
