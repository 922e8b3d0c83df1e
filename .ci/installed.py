"""Checks an installed hmp as a user gets it from the wheel, from outside the clone:

    python .ci/installed.py CLONE [--examples] [--demo]

every module of the installed package imports (a module whose optional library
is not installed must fail naming it, and that library must be one of
pyproject.toml's extras); the installed package is the one imported, not
CLONE's sources; every shipped list loads (O1 and O2); ``python -m hmp
--version`` and the ``hmp`` script; with ``--examples``, CLONE's examples/
(one whose library is missing must say what to pip install); with
``--demo``, a short ``python -m hmp demo``. Run it from a folder outside
CLONE. The same interpreter flags (``-S``) reach every process it starts.
Prints one line per check, exits 1 when any fails.
"""

import argparse
import ast
import importlib
import importlib.util
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLAGS = ["-S"] if sys.flags.no_site else []


def extras(clone):
    """The top-level import names of the libraries pyproject.toml's extras name (a rough mapping:
    the distribution name with '-' as '_'), with scikit-learn's own."""
    text = (clone / "pyproject.toml").read_text()
    names = set(re.findall(r'^\s*"([A-Za-z0-9_.-]+)\s*[<>=!~]', text, re.M))
    return {n.lower().replace("-", "_") for n in names} | {"sklearn"}


def imports(path):
    """The top-level packages a Python file imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


class Checks:
    def __init__(self):
        self.failed, self.done, self.start = [], 0, time.perf_counter()

    def ok(self, what):
        self.done += 1
        print(f"installed: ok: {what}", flush=True)

    def fail(self, what, why):
        self.done += 1
        self.failed.append(what)
        print(f"installed: FAILED: {what}: {why}", flush=True)


def run(args, cwd, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, *FLAGS, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def check_modules(checks, clone, optional):
    import hmp

    where = Path(hmp.__file__).resolve().parent
    if where.is_relative_to(clone):
        checks.fail("the installed hmp is imported", f"hmp came from the clone: {where}")
        return
    checks.ok(f"hmp imported from {where}")
    names = ["hmp"] + [m.name for m in pkgutil.walk_packages(hmp.__path__, "hmp.")]
    sources = {
        ".".join(p.relative_to(clone).with_suffix("").parts).removesuffix(".__init__")
        for p in (clone / "hmp").rglob("*.py")
    }
    missing = sorted(sources - set(names))
    if missing:
        checks.fail("every module of the tree is installed", f"not installed: {', '.join(missing)}")
    skipped = []
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            top = (e.name or "").split(".")[0]
            if top in optional:
                skipped.append(f"{name} (needs {top}, an extra)")
                continue
            checks.fail(f"import {name}", f"{type(e).__name__}: {e}")
        except Exception as e:
            checks.fail(f"import {name}", f"{type(e).__name__}: {e}")
    checks.ok(
        f"{len(names) - len(skipped)} of {len(names)} modules imported" + (f"; {', '.join(skipped)}" * bool(skipped))
    )
    from_clone = [
        n for n in names if n in sys.modules and Path(sys.modules[n].__file__).resolve().is_relative_to(clone)
    ]
    if from_clone:
        checks.fail("no module from the clone", ", ".join(from_clone))
    for level in ("O1", "O2"):
        try:
            hmp.convert(opt_level=level)
            sizes = {k: len(v) for k, v in hmp.effective_lists().items()}
            hmp.revert()
        except Exception as e:
            checks.fail(f"the shipped {level} lists load", f"{type(e).__name__}: {e}")
        else:
            checks.ok(f"the shipped {level} lists load: {sizes}")


def check_commands(checks, here):
    import hmp

    got = run(["-m", "hmp", "--version"], here)
    if got.returncode == 0 and got.stdout.startswith(f"hmp {hmp.__version__} "):
        checks.ok(f"python -m hmp --version: {got.stdout.strip()}")
    else:
        checks.fail("python -m hmp --version", f"exit {got.returncode}: {got.stdout}{got.stderr}")
    script = shutil.which("hmp", path=os.path.dirname(sys.executable))
    if FLAGS:
        return  # a --target install has no scripts; the wheel's entry point is checked in a venv
    if script is None:
        checks.fail("the hmp script", f"no hmp beside {sys.executable}")
        return
    got = subprocess.run([script, "--version"], cwd=here, capture_output=True, text=True, timeout=120)
    if got.returncode == 0 and got.stdout.startswith("hmp "):
        checks.ok(f"{script} --version")
    else:
        checks.fail("the hmp script", f"exit {got.returncode}: {got.stderr[-500:]}")


def check_examples(checks, clone, here, optional):
    for example in sorted((clone / "examples").glob("*.py")):
        needs = sorted(n for n in imports(example) & optional if importlib.util.find_spec(n) is None)
        start = time.perf_counter()
        got = run([str(example)], here)
        took = time.perf_counter() - start
        if needs:
            said = got.returncode != 0 and "ImportError" in got.stderr and "pip install" in got.stderr
            if said:
                checks.ok(f"{example.name}: needs {', '.join(needs)} (not installed) and says what to pip install")
            else:
                checks.fail(example.name, f"needs {', '.join(needs)}, and did not say so: {got.stderr[-800:]}")
        elif got.returncode == 0 and got.stdout.strip():
            checks.ok(f"{example.name} ran ({took:.0f} s)")
        else:
            checks.fail(example.name, f"exit {got.returncode}: {got.stderr[-1500:]}")


def check_readme(checks, clone, here):
    """README's Python example, run as a user of README's venv runs it (the installed wheel, no
    clone on the path), printing what README says it prints."""
    text = (clone / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", text[text.index("<!-- readme example:") :], flags=re.S | re.M)
    (lang, code), (_, expected) = blocks[:2]
    script = Path(here) / "readme_example.py"
    script.write_text(code, encoding="utf-8")
    got = run([str(script)], here)
    if lang == "python" and got.returncode == 0 and got.stdout.split() == expected.split():
        checks.ok("README's example ran in README's venv and printed what README says")
    else:
        checks.fail("README's example", f"exit {got.returncode}: {got.stdout[-500:]}{got.stderr[-1000:]}")


def check_demo(checks, here):
    start = time.perf_counter()
    got = run(["-m", "hmp", "demo", "--steps", "3"], here)
    took = time.perf_counter() - start
    if got.returncode == 0 and "configuration" in got.stdout and "hmp O1" in got.stdout:
        checks.ok(f"python -m hmp demo --steps 3 ({took:.0f} s)")
    else:
        checks.fail("python -m hmp demo --steps 3", f"exit {got.returncode}: {got.stderr[-1500:]}")


def main():
    parser = argparse.ArgumentParser(prog="installed.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("clone", type=Path)
    parser.add_argument("--examples", action="store_true")
    parser.add_argument("--demo", action="store_true")
    args = parser.parse_args()
    clone = args.clone.resolve()
    if Path.cwd().resolve().is_relative_to(clone):
        sys.exit(f"installed.py: run it from a folder outside {clone}")
    optional = extras(clone)
    checks = Checks()
    here = tempfile.mkdtemp(prefix="hmp-installed-")
    try:
        check_modules(checks, clone, optional)
        check_commands(checks, here)
        if args.examples:
            check_examples(checks, clone, here, optional)
            check_readme(checks, clone, here)
        if args.demo:
            check_demo(checks, here)
    finally:
        shutil.rmtree(here, ignore_errors=True)
    took = time.perf_counter() - checks.start
    if checks.failed:
        print(f"installed: {len(checks.failed)} of {checks.done} checks FAILED in {took:.0f} s", flush=True)
        sys.exit(1)
    print(f"installed: all {checks.done} checks ok in {took:.0f} s", flush=True)


if __name__ == "__main__":
    main()
