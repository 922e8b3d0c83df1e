"""Every benchmark script imports and runs, so a rename in hmp cannot leave one broken unnoticed
(benchmarks/mechanisms.py failed at import after one). Each script with a ``__main__`` block names its
quickest run in ``QUICK`` (read from its source, not imported) and this test runs it, unless
test_benchmarks.py runs the script already and checks what it reports (one run of each script in CI,
not two); a module file imports."""

import ast
import os
import re
from pathlib import Path

import pytest
from helpers import run_python

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def _source(path):
    return path.read_text()


def _is_script(path):
    return '__name__ == "__main__"' in _source(path)


def _quick(path):
    """The script's ``QUICK`` (a tuple of command-line arguments), or None."""
    for node in ast.parse(_source(path)).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "QUICK" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def _run_by(test_file):
    """The scripts ``test_file`` runs (``BENCHMARKS / "name.py"`` in its source)."""
    return set(re.findall(r'BENCHMARKS / "(\w+)\.py"', test_file.read_text()))


SCRIPTS = [p for p in sorted(BENCHMARKS.glob("*.py")) if _is_script(p)]
MODULES = [p for p in sorted(BENCHMARKS.glob("*.py")) if not _is_script(p)]
CHECKED = _run_by(Path(__file__).with_name("test_benchmarks.py"))  # run there, with checks of their output
QUICK_HERE = [p for p in SCRIPTS if p.stem not in CHECKED]


def test_every_script_names_its_quickest_run():
    assert SCRIPTS, "no benchmark script found"
    assert [p.name for p in SCRIPTS if _quick(p) is None] == []


def test_every_script_runs_here_or_in_test_benchmarks():
    assert CHECKED and CHECKED <= {p.stem for p in SCRIPTS}, CHECKED  # the reading finds real scripts
    assert {p.stem for p in SCRIPTS} == CHECKED | {p.stem for p in QUICK_HERE}
    assert QUICK_HERE, "every script would be left to test_benchmarks.py"


@pytest.mark.slow  # each a few seconds to two minutes (tune_models tunes a small CNN)
@pytest.mark.parametrize("script", QUICK_HERE, ids=[p.stem for p in QUICK_HERE])
def test_each_script_runs_its_quick_mode(script, tmp_path):
    args = [a.format(tmp=tmp_path) for a in _quick(script)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    p = run_python(str(script), *args, cwd=ROOT, env=env, timeout=900)
    assert p.returncode == 0, (script.name, args, p.stdout[-2000:], p.stderr[-3000:])
    assert p.stdout.strip(), script.name  # it reports something


@pytest.mark.parametrize("module", MODULES, ids=[p.stem for p in MODULES])
def test_each_module_file_imports(module):
    code = f"import sys; sys.path[:0] = [{str(BENCHMARKS)!r}, {str(ROOT)!r}]; import {module.stem}"
    p = run_python("-c", code, cwd=ROOT, timeout=300)
    assert p.returncode == 0, (module.name, p.stderr[-3000:])
