"""What pip installs is the whole package: the wheel and the sdist hold every module and list file
of the tree, and the installed wheel works from any directory, away from this checkout."""

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

import hmp

ROOT = Path(__file__).resolve().parents[2]


# what an editable install or a test run leaves in a checkout: not sources
BUILT_HERE = ("build", "dist", "*.so", "*.egg-info", ".venv", ".git", "__pycache__", ".hypothesis", ".pytest_cache")


def _tree_files():
    """What the wheel and the sdist must hold, from the source tree: ``{path in the wheel: path in the
    tree}`` for every file of hmp/ and of each folder pyproject.toml's package-dir maps to a package
    (op_lists/ as hmp/op_lists/)."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"].get("package-dir", {})
    out = {}
    for inside, folder in [("hmp", "hmp"), *((package.replace(".", "/"), f) for package, f in mapped.items())]:
        for path in (ROOT / folder).rglob("*"):
            rel = path.relative_to(ROOT / folder)
            if path.is_file() and "__pycache__" not in rel.parts and path.suffix != ".pyc":
                out[f"{inside}/{rel.as_posix()}"] = f"{folder}/{rel.as_posix()}"
    return out


def _build(source, out, what):
    """Build ``what`` ("wheel" or "sdist") of the project at ``source`` into ``out`` with the installed
    setuptools (PEP 517's hooks, no isolation: nothing downloaded); the archive's path."""
    code = f"import sys; from setuptools import build_meta; print(build_meta.build_{what}(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", code, str(out)], cwd=source, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


def test_the_wheel_and_the_sdist_hold_every_module_and_list_file(tmp_path):
    """pyproject.toml names hmp's packages one by one (setuptools' find cannot map op_lists/ to
    hmp/op_lists): a package added under hmp/ and not named there, or a list file not matched by the
    package data, fails here. The sdist is checked by building the wheel again from it."""
    pytest.importorskip("setuptools")
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*BUILT_HERE))
    wheel = _build(source, tmp_path / "dist", "wheel")
    sdist = _build(source, tmp_path / "dist", "sdist")
    assert wheel.name.startswith("torch_hmp-") and wheel.name.endswith("-py3-none-any.whl"), wheel.name
    expected = _tree_files()
    assert expected["hmp/op_lists/bf16.txt"] == "op_lists/bf16.txt" and "hmp/driver/conversion.py" in expected
    with zipfile.ZipFile(wheel) as z:
        in_wheel = {n for n in z.namelist() if not n.split("/")[0].endswith(".dist-info")}
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert not set(expected) - in_wheel, f"missing from the wheel: {sorted(set(expected) - in_wheel)}"
    assert not in_wheel - set(expected), f"in the wheel but not in the tree: {sorted(in_wheel - set(expected))}"
    assert "Requires-Dist: torch>=" in metadata and "hmp = hmp.__main__:main" in entry_points
    assert "[pytest11]\nhmp = _hmp_pytest" in entry_points
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python 3.12's default, earlier too
        tar.extractall(tmp_path / "unpacked", **safe)
    sources = set(expected.values())
    assert not sources - in_sdist, f"missing from the sdist: {sorted(sources - in_sdist)}"
    assert {"pyproject.toml", "setup.cfg", "README.md"} <= in_sdist
    again = _build(tmp_path / "unpacked" / top, tmp_path / "from-sdist", "wheel")
    with zipfile.ZipFile(again) as z:
        from_sdist = {n for n in z.namelist() if not n.split("/")[0].endswith(".dist-info")}
    assert from_sdist == in_wheel, sorted(from_sdist ^ in_wheel)


@pytest.mark.slow
@pytest.mark.torch_internals
def test_the_installed_wheel_works_from_anywhere(tmp_path):
    """The wheel installed into a folder of its own, run from another folder with ``-S`` (no
    site-packages .pth files, so the editable install of this checkout cannot answer an import; torch's
    own folder is put on the path instead): .ci/installed.py imports every module from the installed
    copy, loads every shipped list and runs ``python -m hmp --version``. CI's wheel leg runs the same
    script in a fresh venv, with the examples and a short demo."""
    pytest.importorskip("setuptools")
    source, site = tmp_path / "source", tmp_path / "site"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*BUILT_HERE))
    wheel = _build(source, tmp_path / "dist", "wheel")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    assert (site / "hmp" / "op_lists" / "bf16.txt").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    libraries = {str(Path(torch.__file__).parents[1])} | {str(Path(p)) for p in sys.path if p.endswith("site-packages")}
    env = {"PYTHONPATH": os.pathsep.join([str(site), *sorted(libraries)]), "PATH": os.environ.get("PATH", "")}
    done = subprocess.run(
        [sys.executable, "-S", str(ROOT / ".ci" / "installed.py"), str(ROOT)],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"hmp imported from {site.resolve() / 'hmp'}" in done.stdout, done.stdout
    assert "python -m hmp --version: hmp " in done.stdout and "all " in done.stdout.splitlines()[-1]


def test_requirements_never_cap_torch_and_start_at_the_floor_ci_tests():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_req,) = [d for d in project["dependencies"] if re.match(r"torch\b", d)]
    assert "<" not in torch_req and "==" not in torch_req and "~=" not in torch_req, torch_req
    assert re.search(r">=\s*([\d.]+)", torch_req).group(1) == hmp.tested.TESTED_TORCH[0]
    assert project["name"] != "hmp"  # that name on the package index is another project
    bare = re.compile(r"(?<![\w-])hmp\[")  # `pip install "hmp[...]"`: the other project
    assert not [
        line
        for f in [*(ROOT / "docs").glob("*.md"), ROOT / "README.md", *(ROOT / "hmp").rglob("*.py")]
        for line in f.read_text().splitlines()
        if "pip install" in line and bare.search(line)
    ]


def test_a_pip_install_shown_works_before_the_package_is_published():
    """torch-hmp is not on the package index: a `pip install "torch-hmp[...]"` a user reads would fail.
    Shown are installs from a checkout (".[extra]", each extra one pyproject.toml declares), from a
    URL (`torch-hmp[extra] @ git+...`), or the published form on a line that says it is for later."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    files = [*(ROOT / "docs").glob("*.md"), ROOT / "README.md", *(ROOT / "hmp").rglob("*.py")]
    files += [*(ROOT / "examples").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    unpublished, unknown = [], []
    for f in files:
        for number, line in enumerate(f.read_text().splitlines(), 1):
            if "pip install" not in line:
                continue
            where = f"{f.relative_to(ROOT)}:{number}: {line.strip()}"
            if re.search(r"torch-hmp\[[^\]]*\](?!\s*@)", line) and "published" not in line:
                unpublished.append(where)
            for group in re.findall(r"(?:torch-hmp|\.)\[([^\]]+)\]", line):
                unknown += [f"{where} ({name})" for name in group.split(",") if name.strip() not in extras]
    assert not unpublished, "installs from the package index, where torch-hmp is not:\n" + "\n".join(unpublished)
    assert not unknown, "extras pyproject.toml does not declare:\n" + "\n".join(unknown)


def test_a_torch_newer_than_ci_tested_is_said_once(recwarn):
    from hmp import tested

    newest = tested.TESTED_TORCH[-1]
    major, minor, _ = tested.release(newest)
    newer = f"{major}.{minor + 1}.0+cu999"
    hmp.core.state.warned.discard(("untested torch", newer))
    tested.warn_if_newer(newest)
    tested.warn_if_newer(newer)
    tested.warn_if_newer(newer)
    said = [str(w.message) for w in recwarn if "newer than the newest release" in str(w.message)]
    assert len(said) == 1 and newer in said[0] and newest in said[0]
