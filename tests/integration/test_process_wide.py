"""Process-wide effects: importing hmp or any of its modules patches nothing
and imports no optional dependency; only convert() patches, and revert()
puts back everything convert() touched (namespaces, logging); the
exception hooks are never touched."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# every module of the package but those whose subcommand or framework loads
# what hmp itself must not (the demo and tune: tqdm; the Lightning plugin:
# lightning; the testing kit's strategies, check and pytest hooks: hypothesis
# and pytest, which a test run has loaded already; CUDA's cast kernel: triton, imported
# at the first cast on CUDA)
NOT_PROBED = {
    "hmp.testing.checking",
    "hmp.testing.strategies",
    "hmp.testing.pytest_hooks",
    "hmp.demo",
    "hmp.demo.data",
    "hmp.demo.model",
    "hmp.demo.training",
    "hmp.tools.tune_cli",
    "hmp.integrations.lightning",
    "hmp.core.saturating_kernel",
}
ALL_MODULES = sorted(
    ".".join(("hmp",) + p.relative_to(ROOT / "hmp").with_suffix("").parts).removesuffix(".__init__")
    for p in (ROOT / "hmp").rglob("*.py")
)
MODULES = ["hmp.core.state"] + [m for m in ALL_MODULES if m not in NOT_PROBED and m != "hmp.core.state"]

PROBE = textwrap.dedent(r"""
    import importlib, logging, sys, threading, warnings
    import torch, torch.nn.functional as F
    # torch's own import side effects, not hmp's: on torch 2.4 importing
    # torch.utils.checkpoint imports torch._inductor and adds a warnings filter
    import torch.utils.checkpoint

    def world():
        spaces = {n: dict(vars(ns)) for n, ns in
                  (("torch", torch), ("F", F), ("Tensor", torch.Tensor), ("TensorBase", torch._C.TensorBase),
                   ("nn.Module", torch.nn.Module), ("Parameter", torch.nn.Parameter))}
        return {
            "namespaces": {n: {k: id(v) for k, v in d.items()} for n, d in spaces.items()},
            "hooks": (id(sys.excepthook), id(threading.excepthook), id(sys.unraisablehook),
                      sys.getprofile(), sys.gettrace()),
            "warnings": list(warnings.filters),
            "logging": (list(logging.getLogger().handlers), logging.getLogger().level,
                        list(logging.getLogger("hmp").handlers), logging.getLogger("hmp").level),
            "torch": (torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
                      torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()),
        }

    def diff(a, b):
        out = []
        for key in a:
            if key == "namespaces":
                for n in a[key]:
                    x, y = a[key][n], b[key][n]
                    changed = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
                    if changed:
                        out.append(f"{n}: {changed[:8]}")
            elif a[key] != b[key]:
                out.append(key)
        return out

    OPTIONAL = ("torchvision", "habana_frameworks", "tqdm", "matplotlib", "lightning", "pytorch_lightning",
                "pytest", "hypothesis", "setuptools", "pkg_resources", "transformers", "apex", "IPython", "triton")
    start, loaded = world(), set(sys.modules)
    for name in sys.argv[1:]:
        importlib.import_module(name)
        assert not diff(start, world()), f"import {name} changed {diff(start, world())}"
    new = sorted(m for m in set(sys.modules) - loaded if m.split(".")[0] in OPTIONAL)
    assert not new, f"import hmp loaded optional dependencies: {new}"
    assert "torch._dynamo" not in sys.modules, "import hmp imported dynamo"

    # convert() imports dynamo (hmp/core/wrap.py's ready_for_compile): its import
    # side effects (torch.manual_seed wrapped, a warnings filter) are torch's, not hmp's
    import torch._dynamo

    import hmp
    # convert() imports torchvision.ops where installed, to bind its ops:
    # torchvision's own import side effects (a warnings filter) are not hmp's
    try:
        import torchvision.ops
    except Exception:
        pass
    start = world()
    hmp.convert()
    changed = diff(start, world())
    # nn.Module: load_state_dict (weight_writes.py); construction is torch's own (pointwise ops need no
    # uncast entry); the exception, profile and trace hooks are never touched
    assert changed and all(c.split(":")[0] in ("torch", "F", "Tensor", "nn.Module") for c in changed), changed
    assert [c for c in changed if c.startswith("nn.Module")] == [
        "nn.Module: ['load_state_dict']"]
    hmp.convert(opt_level="O2", isVerbose=True)
    hmp.revert()
    assert not diff(start, world()), f"revert left {diff(start, world())}"
    assert "habana_frameworks" not in sys.modules
    print("ok", len(sys.argv) - 1, "modules;", "torchvision" in sys.modules)
""")


def run_probe(tmp_path, modules, extra_path=None):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env_path = [str(ROOT)] + ([str(extra_path)] if extra_path else [])
    res = subprocess.run(
        [sys.executable, str(script), *modules],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env={"PYTHONPATH": ":".join(env_path), "PATH": "/usr/bin:/bin"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_importing_each_module_patches_nothing_and_only_convert_does(tmp_path):
    """Each module alone first (the package's __init__ runs for any of them),
    then the rest; the world is compared after every import."""
    out = run_probe(tmp_path, MODULES)
    assert out.startswith(f"ok {len(MODULES)} modules")


def test_import_never_loads_installed_optional_packages(tmp_path):
    """Fake torchvision and habana_frameworks packages on the path: importing
    hmp loads neither; convert() loads torchvision.ops (it binds ops there, as
    documented) and never habana_frameworks."""
    fake = tmp_path / "site"
    (fake / "torchvision" / "ops").mkdir(parents=True)
    (fake / "torchvision" / "__init__.py").write_text("")
    (fake / "torchvision" / "ops" / "__init__.py").write_text("def nms(boxes, scores, iou): return boxes\n")
    (fake / "habana_frameworks").mkdir()
    (fake / "habana_frameworks" / "__init__.py").write_text("raise ImportError('must never be imported')\n")
    out = run_probe(tmp_path, ["hmp"], extra_path=fake)
    assert out.strip().endswith("True")  # convert() imported the (fake) torchvision.ops
