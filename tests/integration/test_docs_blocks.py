"""Every ```python block in README.md and docs/*.md runs as pasted, or says why not.

A block runs in a fresh process from an empty directory, with this checkout on
PYTHONPATH: what a reader gets who pastes it into a file. A block that is not
meant to run alone (it uses the reader's model, continues the block above, needs
another launcher) is marked on the line right before it:

    <!-- fragment: why it does not run alone -->

README's first block carries `<!-- readme example: ... -->` instead:
tests/integration/test_readme.py runs it and compares all of its output.

A ```text block marked `<!-- output of the block above -->` shows what the
python block before it prints; the lines hmp writes (those starting with
`hmp` and the indented lines after them) must be printed as shown. Other lines
(torch's own messages, numbers) are illustrations and are not compared."""

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import imported_packages

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = re.compile(r"^<!-- fragment: (.*\S) -->$")
TESTED_ELSEWHERE = "<!-- readme example:"
OUTPUT = "<!-- output of the block above -->"
# importing any of these takes seconds (about 4 s on a 2-core CPU), so such blocks are slow
HEAVY = {"transformers", "lightning", "diffusers", "peft", "accelerate", "timm"}


def fenced_blocks(path):
    """Every fenced block of a markdown file: dicts with the language, the code,
    the line number of the opening fence, and the line before it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = re.match(r"^```(\w*)\s*$", lines[i])
        if opening:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
            assert end is not None, f"{path.name}:{i + 1}: fenced block never closed"
            blocks.append(
                {
                    "lang": opening.group(1),
                    "code": "\n".join(lines[i + 1 : end]) + "\n",
                    "line": i + 1,
                    "before": lines[i - 1].strip() if i else "",
                }
            )
            i = end
        i += 1
    return blocks


def python_blocks():
    for doc in DOCS:
        blocks = fenced_blocks(doc)
        for k, block in enumerate(blocks):
            if block["lang"] != "python":
                continue
            following = blocks[k + 1] if k + 1 < len(blocks) else None
            expected = following["code"] if following and following["before"] == OUTPUT else None
            yield doc, block, expected


def _parses(code):
    try:
        ast.parse(code)
    except SyntaxError:
        return False
    return True


def runnable_params():
    params = []
    for doc, block, expected in python_blocks():
        if FRAGMENT.match(block["before"]) or block["before"].startswith(TESTED_ELSEWHERE):
            continue
        slow = bool(imported_packages(block["code"]) & HEAVY) if _parses(block["code"]) else False
        params.append(
            pytest.param(
                block["code"],
                expected,
                marks=[pytest.mark.slow] if slow else [],
                id=f"{doc.relative_to(ROOT)}:{block['line']}",
            )
        )
    return params


def hmp_lines(text):
    """The lines hmp writes: those starting with `hmp` and the indented lines after them."""
    out, inside = [], False
    for line in text.splitlines():
        inside = line.startswith("hmp") or (inside and line[:1].isspace())
        if inside:
            out.append(line.rstrip())
    return out


@pytest.mark.parametrize("code, expected", runnable_params())
def test_block_runs_as_pasted(code, expected, tmp_path):
    assert _parses(code), "not valid Python: mark it <!-- fragment: REASON --> if it is not meant to run"
    missing = sorted(name for name in imported_packages(code) if importlib.util.find_spec(name) is None)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}, not installed")
    (tmp_path / "block.py").write_text(code, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "block.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (
        f"the block does not run as pasted; make it self-contained or mark it "
        f"<!-- fragment: REASON -->\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    )
    if expected is None:
        return
    if "__notes__" in code and sys.version_info < (3, 11):
        pytest.skip("the output shows exception notes, which Python 3.11 added")
    printed = [line.rstrip() for line in (done.stdout + done.stderr).splitlines()]
    for line in hmp_lines(expected):
        assert line in printed, f"the docs show {line!r}, which the block does not print; it printed:\n" + "\n".join(
            printed
        )


def test_markers_sit_right_before_the_blocks_they_describe():
    """A fragment marker with no reason, or one that is not on the line before a
    ```python fence, would mark nothing (or the wrong block)."""
    problems = []
    for doc in DOCS:
        lines = doc.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            where = f"{doc.relative_to(ROOT)}:{i + 1}"
            after = lines[i + 1].strip() if i + 1 < len(lines) else ""
            if line.strip().startswith("<!-- fragment"):
                if not FRAGMENT.match(line.strip()):
                    problems.append(f"{where}: write it as <!-- fragment: REASON -->")
                if after != "```python":
                    problems.append(f"{where}: a fragment marker must be right before a ```python block")
            if line.strip() == OUTPUT and after != "```text":
                problems.append(f"{where}: an output marker must be right before a ```text block")
    for doc in DOCS:
        blocks = fenced_blocks(doc)
        for k, block in enumerate(blocks):
            if block["before"] == OUTPUT:
                previous = blocks[k - 1] if k else None
                if previous is None or previous["lang"] != "python" or FRAGMENT.match(previous["before"]):
                    problems.append(f"{doc.relative_to(ROOT)}:{block['line']}: output of no runnable python block")
                elif not hmp_lines(block["code"]):
                    problems.append(
                        f"{doc.relative_to(ROOT)}:{block['line']}: an output block with no hmp line checks nothing"
                    )
    assert not problems, "\n".join(problems)


def test_readme_example_is_tested_elsewhere():
    """README's first block is left to test_readme.py, which finds it by the same marker."""
    readme = [b for doc, b, _ in python_blocks() if doc.name == "README.md"]
    assert readme and readme[0]["before"].startswith(TESTED_ELSEWHERE)
    assert (ROOT / "tests" / "integration" / "test_readme.py").read_text(encoding="utf-8").count(TESTED_ELSEWHERE)


def test_install_commands_in_bash_blocks_work_before_the_package_is_published():
    """A ```bash block's `pip install` installs from a checkout (the package is
    not on the index yet), with extras that pyproject.toml defines; the index
    name appears only as prose, for when it is published."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras, name = set(project["optional-dependencies"]), project["name"]
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), flags=re.S):
            for command in re.findall(r"pip install ([^\n&]*)", block):
                assert f'"{name}[' not in command and not command.startswith(name), (doc.name, command)
                for extra in re.findall(r'"\.\[([\w,-]+)\]"', command):
                    assert set(extra.split(",")) <= extras, (doc.name, command)
    assert 'pip install -e ".[lightning]"' in (ROOT / "docs" / "integrations.md").read_text()
