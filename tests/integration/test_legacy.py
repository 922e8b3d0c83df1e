"""python -m hmp run: scripts written for Habana's hmp run unchanged."""

import importlib
import importlib.util
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hmp
from hmp.integrations import habana_runner as legacy

ROOT = Path(__file__).resolve().parents[2]

# The Habana tutorial loop, as written for Gaudi with the (removed) hmp.
LEGACY_SCRIPT = """\
import argparse
import sys

import torch
from habana_frameworks.torch.hpex import hmp
import habana_frameworks.torch.core as htcore
import habana_frameworks.torch.hpu as hthpu

parser = argparse.ArgumentParser(description="Habana HMP tutorial")
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--exit-code", type=int, default=0)
parser.add_argument("--fail", action="store_true")
args = parser.parse_args()

device = torch.device("hpu" if hthpu.is_available() else "cpu")
hmp.convert(opt_level="O1", bf16_file_path="", fp32_file_path="", isVerbose=False)

torch.manual_seed(0)
x = torch.randn(256, 32)
y = x @ torch.randn(32, 8)
model = torch.nn.Linear(32, 8).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
losses = []
for t in range(args.steps):
    y_pred = model(x.to(device))
    loss = torch.nn.functional.mse_loss(y_pred.float(), y.to(device))
    optimizer.zero_grad()
    loss.backward()
    htcore.mark_step()
    with hmp.disable_casts():
        optimizer.step()
    htcore.mark_step()
    losses.append(loss.item())
    if args.fail:
        raise RuntimeError("training diverged")

print("argv", sys.argv)
print("name", __name__)
print("device", device)
print("hmp", hmp.__name__, hmp.is_converted())
print("dtypes", y_pred.dtype, model.weight.dtype, model.weight.grad.dtype)
print("loss", losses[0], losses[-1])
sys.exit(args.exit_code)
"""


def run_hmp(args, cwd, extra_path=()):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, extra_path), str(ROOT)])
    return subprocess.run(
        [sys.executable, "-m", "hmp", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def lines(stdout):
    return dict(line.split(" ", 1) for line in stdout.splitlines() if " " in line)


@pytest.fixture
def script(tmp_path):
    folder = tmp_path / "scripts"
    folder.mkdir()
    path = folder / "train_hmp.py"
    path.write_text(LEGACY_SCRIPT)
    return path


@pytest.fixture
def elsewhere(tmp_path):
    path = tmp_path / "elsewhere"
    path.mkdir()
    return path


@pytest.mark.skipif(importlib.util.find_spec("habana_frameworks") is not None, reason="Habana software installed")
def test_legacy_script_runs_unchanged(script, elsewhere):
    res = run_hmp(["run", str(script), "--steps", "5"], cwd=elsewhere)
    assert res.returncode == 0, res.stderr
    out = lines(res.stdout)
    assert out["argv"] == repr([str(script), "--steps", "5"])
    assert out["name"] == "__main__"
    assert out["device"] == "cpu"
    assert out["hmp"] == "hmp True"  # the import resolved to this package
    assert out["dtypes"] == "torch.bfloat16 torch.float32 torch.float32"
    first, last = map(float, out["loss"].split())
    assert last < first


def test_exit_code_of_the_script_propagates(script, elsewhere):
    res = run_hmp(["run", str(script), "--steps", "1", "--exit-code", "3"], cwd=elsewhere)
    assert res.returncode == 3, res.stderr


def test_exception_in_the_script(script, elsewhere):
    res = run_hmp(["run", str(script), "--steps", "2", "--fail"], cwd=elsewhere)
    assert res.returncode == 1
    assert "RuntimeError: training diverged" in res.stderr


def test_script_options_are_not_hmps(script, elsewhere):
    res = run_hmp(["run", str(script), "-h"], cwd=elsewhere)
    assert res.returncode == 0, res.stderr
    assert "Habana HMP tutorial" in res.stdout and "--steps" in res.stdout


def test_relative_path_and_script_directory_first_on_sys_path(tmp_path):
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "helper.py").write_text("VALUE = 'helper next to the script'\n")
    (folder / "main.py").write_text(
        textwrap.dedent("""\
        import sys
        import helper
        from habana_frameworks.torch.hpex import hmp
        print("helper", helper.VALUE)
        print("path0", sys.path[0])
        print("argv", sys.argv)
    """)
    )
    res = run_hmp(["run", "proj/main.py", "a", "--b"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = lines(res.stdout)
    assert out["helper"] == "helper next to the script"
    assert out["path0"] == str(folder.resolve())
    assert out["argv"] == repr(["proj/main.py", "a", "--b"])


SIBLING_SCRIPT = """\
import os
import pickle
import sys

here = os.path.dirname(__file__)
os.chdir(os.path.dirname(here))  # the script moves away, then reads the file next to itself
with open(os.path.join(here, "settings.txt")) as f:
    print("settings", f.read().strip())
print("file", __file__)
print("main", sys.modules["__main__"].__dict__ is globals())


class Point:  # pickles as __main__.Point, as under python
    pass


print("pickled", type(pickle.loads(pickle.dumps(Point()))).__qualname__)


def fail():
    raise ValueError("from the script")


if sys.argv[1:] == ["--fail"]:
    fail()
"""


def test_script_finds_its_sibling_file_after_changing_directory(tmp_path):
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "settings.txt").write_text("lr=0.1\n")
    (folder / "main.py").write_text(SIBLING_SCRIPT)
    res = run_hmp(["run", "proj/main.py"], cwd=tmp_path)  # a relative path, as users type it
    assert res.returncode == 0, res.stderr
    out = lines(res.stdout)
    assert out["settings"] == "lr=0.1"
    assert os.path.isabs(out["file"]) and os.path.samefile(out["file"], folder / "main.py")
    assert out["main"] == "True" and out["pickled"] == "Point"


def test_traceback_starts_at_the_script_as_under_python(tmp_path):
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "settings.txt").write_text("lr=0.1\n")
    (folder / "main.py").write_text(SIBLING_SCRIPT)
    res = run_hmp(["run", "proj/main.py", "--fail"], cwd=tmp_path)
    python = subprocess.run(
        [sys.executable, "proj/main.py", "--fail"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == python.returncode == 1
    tb = res.stderr.splitlines()
    assert tb[0] == "Traceback (most recent call last):"
    assert tb[1].startswith(f'  File "{folder / "main.py"}", line ') and tb[1].endswith("in <module>")
    assert not [line for line in tb if "legacy.py" in line or "runpy" in line or "__main__.py" in line]
    assert tb[1:] == python.stderr.splitlines()[1:]  # the same frames and message as python's


@pytest.mark.skipif(sys.version_info < (3, 11), reason="add_note is Python 3.11+")
def test_uncaught_mismatch_is_noted_only_while_converted(tmp_path):
    """The runner notes the script's uncaught dtype mismatch (tests/unit/diagnostics/test_errors.py)
    only while hmp is converted: the lists a note names are the conversion's."""
    path = tmp_path / "mismatch.py"
    path.write_text(
        "import sys, torch\n"
        "from habana_frameworks.torch.hpex import hmp\n"
        "hmp.binding.lists.fallback_names = lambda low: ()  # an op the fallback lists do not cover\n"
        "if '--convert' in sys.argv:\n"
        "    hmp.convert()\n"
        "torch.addbmm(torch.randn(2, 2), torch.randn(1, 2, 2).bfloat16(), torch.randn(1, 2, 2).bfloat16())\n"
    )
    plain = run_hmp(["run", str(path)], cwd=tmp_path)
    converted = run_hmp(["run", str(path), "--convert"], cwd=tmp_path)
    assert plain.returncode == converted.returncode == 1
    assert "must have the same dtype" in plain.stderr and "hmp:" not in plain.stderr
    assert converted.stderr.splitlines()[-1].startswith("hmp: addbmm got lower-precision and float32 tensors")


def test_missing_script(elsewhere):
    res = run_hmp(["run", "no_such_script.py"], cwd=elsewhere)
    assert res.returncode == 2
    assert "no_such_script.py" in res.stderr


def test_unprovided_habana_module_says_so(tmp_path):
    path = tmp_path / "opt.py"
    path.write_text("from habana_frameworks.torch.hpex.optimizers import FusedAdamW\n")
    res = run_hmp(["run", str(path)], cwd=tmp_path)
    assert res.returncode == 1
    assert "ModuleNotFoundError" in res.stderr and "Habana software is not installed" in res.stderr


def test_nothing_is_installed_outside_the_process(script, elsewhere):
    assert run_hmp(["run", str(script), "--steps", "1"], cwd=elsewhere).returncode == 0
    res = subprocess.run(
        [sys.executable, "-c", "import habana_frameworks"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if importlib.util.find_spec("habana_frameworks") is None:
        assert res.returncode != 0 and "No module named 'habana_frameworks'" in res.stderr


def test_real_habana_software_is_used_for_everything_but_hmp(tmp_path, script, elsewhere):
    """A stand-in for an installed Habana stack (one that still has its own hmp)."""
    site = tmp_path / "site"
    pkg = site / "habana_frameworks" / "torch"
    (pkg / "hpex").mkdir(parents=True)
    (site / "habana_frameworks" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "hpu.py").write_text("def is_available():\n    return False\n")
    (pkg / "core.py").write_text(
        "calls = []\n"
        "def mark_step():\n"
        "    calls.append(1)\n"
        "import atexit\n"
        "atexit.register(lambda: print('real mark_step calls', len(calls)))\n"
    )
    (pkg / "hpex" / "__init__.py").write_text("")
    (pkg / "hpex" / "hmp.py").write_text("raise ImportError('the real Habana hmp must not be used')\n")
    res = run_hmp(["run", str(script), "--steps", "3"], cwd=elsewhere, extra_path=[site])
    assert res.returncode == 0, res.stderr
    out = lines(res.stdout)
    assert out["hmp"] == "hmp True"
    assert out["real"] == "mark_step calls 6"


def test_cli_help_lists_run(elsewhere):
    res = run_hmp(["--help"], cwd=elsewhere)
    assert res.returncode == 0, res.stderr
    assert "run" in res.stdout


@pytest.mark.skipif(importlib.util.find_spec("habana_frameworks") is not None, reason="Habana software installed")
def test_install_in_process_and_uninstall():
    legacy.install()
    try:
        hpex = importlib.import_module("habana_frameworks.torch.hpex")
        import habana_frameworks.torch.core as htcore  # noqa: E402
        import habana_frameworks.torch.hpex.hmp as by_path  # noqa: E402
        from habana_frameworks.torch.hpex import hmp as habana_hmp  # noqa: E402

        assert habana_hmp is hmp and by_path is hmp and hpex.hmp is hmp
        assert hmp.__spec__.name == "hmp"  # aliasing left hmp's own spec alone
        assert htcore.mark_step() is None
        from habana_frameworks.torch.utils.library_loader import load_habana_module  # noqa: E402

        load_habana_module()
        habana_hmp.convert()
        assert hmp.is_converted()
    finally:
        legacy.uninstall()
    assert "habana_frameworks" not in sys.modules and not any(isinstance(f, legacy.HabanaFinder) for f in sys.meta_path)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("habana_frameworks")


def test_run_without_a_script_says_what_to_give(tmp_path):
    res = run_hmp(["run"], cwd=tmp_path)
    assert res.returncode == 2
    assert "name the script to run: python -m hmp run train.py" in res.stderr
    assert "args" not in res.stderr.replace("arguments", "")


def test_version_names_hmp_and_torch(tmp_path):
    res = run_hmp(["--version"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    expected = f"hmp {hmp.__version__} (torch {torch.__version__}, Python {platform.python_version()})"
    assert res.stdout.strip() == expected
