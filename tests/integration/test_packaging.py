"""The shipped list files work from an installed wheel, from any directory."""

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
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("hmp-*.whl")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=300,
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
    res = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    where, counts, dtype = res.stdout.split("\n")[:3]
    assert where.startswith(str(site)), where  # the installed copy, not the source tree
    hmp.convert()  # the source tree's lists, in this process
    expected = f"{len(hmp.effective_lists()['bf16'])} {len(hmp.effective_lists()['fp32'])}"
    hmp.revert()
    assert counts == expected and dtype == "torch.bfloat16"

