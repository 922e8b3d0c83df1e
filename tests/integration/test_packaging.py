"""The shipped list files work from an installed wheel, from any directory."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hmp

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.torch_internals
def test_installed_wheel_finds_its_lists(tmp_path):
    pytest.importorskip("setuptools")
    wheels, site, source = tmp_path / "wheels", tmp_path / "site", tmp_path / "source"
    # the sources alone: no build folder or extension an editable install left in this checkout
    built_here = ("build", "dist", "*.so", "*.egg-info", ".venv", ".git", "__pycache__", ".hypothesis")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*built_here))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)]
        + [str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("torch_hmp-*.whl")  # the distribution's name; the import name is hmp
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name  # pure Python: one wheel for every platform
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
    code = (
        "import hmp, torch\n"
        "hmp.convert()\n"
        "print(hmp.__file__)\n"
        "print(len(hmp.effective_lists()['bf16']), len(hmp.effective_lists()['fp32']))\n"
        "print(torch.nn.functional.linear(torch.randn(2, 3), torch.randn(4, 3)).dtype)\n"
        "hmp.convert(opt_level='O2')\n"
    )
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=elsewhere, capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 0, res.stderr
    where, counts, dtype = res.stdout.split("\n")[:3]
    assert where.startswith(str(site)), where  # the installed copy, not the source tree
    hmp.convert()  # the source tree's lists, in this process
    expected = f"{len(hmp.effective_lists()['bf16'])} {len(hmp.effective_lists()['fp32'])}"
    hmp.revert()
    assert counts == expected and dtype == "torch.bfloat16"


def test_requirements_never_cap_torch_and_start_at_the_floor_ci_tests():
    import re

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
