"""The package's shape, checked from its source: floors (core at the
bottom, nothing importing upward), no import cycle, state in one leaf module
written by the driver's conversion.py only, imports at the top, module names
no public function shadows, and one wrapper body for every kind of wrapper."""

import ast
import inspect
import json
import re
import subprocess
import sys
import tokenize
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hmp
from hmp.binding import wrapper_life
from hmp.core import wrap

PACKAGE = Path(hmp.__file__).resolve().parent
# optional or platform-only modules may be imported where they are needed
# tqdm: the demo extra; the Triton kernel of CUDA's cast, imported at the first cast there
LOCAL_IMPORTS_ALLOWED = {"resource", "tqdm", "hmp.core.saturating_kernel"}


def module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


PATHS = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
SOURCES = {m: ast.parse(p.read_text(), str(p)) for m, p in PATHS.items()}
SOURCE_TEXT = {m: p.read_text() for m, p in PATHS.items()}


def imported(module, tree):
    """``[(node, name of what it imports, at module level?)]``: hmp modules by
    their full name, other imports by what they name."""
    package = module if PATHS[module].name == "__init__.py" else module.rpartition(".")[0]
    # module level: the module's statements, and those of a module-level try (an optional import)
    top = set(map(id, tree.body)) | {id(s) for n in tree.body if isinstance(n, ast.Try) for s in n.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node, alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.append((node, full if full in SOURCES else base, id(node) in top))
    return out


def graph():
    return {
        m: {name for _, name, _ in imported(m, tree) if name in SOURCES and name != m} for m, tree in SOURCES.items()
    }


def cycles(edges):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_planted_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_hmp_modules():
    # the package __init__ imports the public API; no module of it imports hmp back
    assert cycles(graph()) == []


def reached(edges, start):
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for n in edges.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def test_a_kind_record_reaches_nothing_of_the_call_path():
    """A tool that wants a list's title or file loads the kinds' records, not
    the wrapper body: kinds names policy factories and imports none of them."""
    call_path = {"hmp.core.wrap", "hmp.core.policy", "hmp.core.cast_copies", "hmp.core.cache", "hmp.core.rescue"}
    assert reached(graph(), "hmp.binding.kinds") & call_path == set()
    assert reached({"a": {"b"}, "b": {"hmp.core.wrap"}}, "a") & call_path == {"hmp.core.wrap"}


def test_state_is_a_leaf():
    # torch_private and torch_releases (the table of what each release has, over torch_private)
    # are the modules state may use: leaves too
    leaves = {"hmp.core.torch_private", "hmp.core.torch_releases"}
    assert graph()["hmp.core.state"] <= leaves
    assert graph()["hmp.core.torch_private"] == set()
    assert graph()["hmp.core.torch_releases"] == {"hmp.core.torch_private"}
    assert not [
        name
        for _, name, _ in imported("hmp.core.state", SOURCES["hmp.core.state"])
        if name.startswith("hmp") and name not in leaves
    ]


def test_imports_are_at_module_level():
    local = [
        f"{m}:{node.lineno} {name}"
        for m, tree in SOURCES.items()
        for node, name, top in imported(m, tree)
        if not top
        and name not in LOCAL_IMPORTS_ALLOWED
        and not (isinstance(node, ast.Import) and all(a.name in LOCAL_IMPORTS_ALLOWED for a in node.names))
    ]
    assert local == []


def test_only_conversion_writes_the_runtime():
    writers = set()
    for m, tree in SOURCES.items():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                while isinstance(t, (ast.Attribute, ast.Subscript)):
                    t = t.value
                    if (
                        isinstance(t, ast.Name)
                        and t.id in ("runtime", "rt")
                        or isinstance(t, ast.Attribute)
                        and t.attr == "runtime"
                    ):
                        writers.add(m)
    assert writers == {"hmp.driver.conversion"}


def _thread_state_writes(tree):
    """Lines assigning a thread's cast state (``<x>.off``, ``<x>.lower_mode``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(el, ast.Attribute) and el.attr in ("off", "lower_mode"):
                        found.append(node.lineno)
    return found


def test_one_protocol_writes_the_thread_cast_state():
    # state.enter()/leave() everywhere; the per-call bodies (wrap.py, the BF16 module's mode in
    # module_rules.py, the cast down) inline the pair, and only from off == 0 back to 0: all of them in core/
    writers = {m for m, tree in SOURCES.items() if _thread_state_writes(tree)}
    assert writers == {"hmp.core.state", "hmp.core.wrap", "hmp.core.module_rules", "hmp.core.cast_copies"}
    for m in ("hmp.core.wrap", "hmp.core.module_rules", "hmp.core.cast_copies"):
        lines = SOURCE_TEXT[m].splitlines()
        for n in _thread_state_writes(SOURCES[m]):
            assert lines[n - 1].strip() in ("st.off = OFF", "st.off = 0") or lines[n - 1].strip().startswith(
                "st.off = OFF  #"
            ), f"{m}:{n}: {lines[n - 1].strip()}"


def test_no_public_name_shadows_a_module():
    shadowed = [
        name for name in dir(hmp) if f"hmp.{name}" in SOURCES and not isinstance(getattr(hmp, name), types.ModuleType)
    ]
    assert shadowed == []


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * x

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_every_kind_of_wrapper_runs_one_body():
    @hmp.bf16_function
    def user_fn(x):
        return x

    bodies = set()
    hmp.register(Square, "apply", "fp32")
    try:
        with hmp.converted():
            op_wrapped = hmp.op_wrap(torch.relu, hmp.to_bf16)
            for fn in (
                F.linear,
                torch.Tensor.mm,
                torch.Tensor.index_put_,  # in place, promote list
                torch.softmax,
                Square.apply,
                user_fn,
                op_wrapped,
            ):
                assert wrapper_life.is_wrapper(fn) and isinstance(fn, types.FunctionType), fn
                bodies.add(fn.__code__)
            assert user_fn(torch.ones(2)).dtype == torch.bfloat16
    finally:
        hmp.unregister(Square, "apply")
    assert bodies == {wrap._BODY}
    # paused while not converted: the decorated function is a plain call
    assert user_fn(torch.ones(2)).dtype == torch.float32


@pytest.mark.parametrize("name", sorted(m.rpartition(".")[2] for m in SOURCES if m.count(".") == 1))
def test_module_is_importable_under_its_name(name):
    assert isinstance(__import__(f"hmp.{name}", fromlist=["_"]), types.ModuleType)


# -- private torch names live in hmp/core/torch_private.py only ------------------------------------------


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_names(tree):
    """Names bound to torch or one of its modules/attributes by an import."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names}
    return names


def _rooted(node, roots):
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return isinstance(node, ast.Name) and node.id in roots


def _owned_private_names():
    """Private attribute names torch_private reaches (``_version``, ``_enabled``
    ...): no other module may name them, as attributes or as strings."""
    owned = set()
    for node in ast.walk(SOURCES["hmp.core.torch_private"]):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owned.add(node.attr)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.isidentifier()
            and _private(node.value)
        ):
            owned.add(node.value)
    return owned


def private_torch_accesses(module, tree, owned):
    roots = _torch_names(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{module}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and not node.level:
            parts = (node.module or "").split(".")
            if parts[0] == "torch" and (any(map(_private, parts)) or any(_private(a.name) for a in node.names)):
                found.append(f"{where} from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [
                f"{where} import {a.name}"
                for a in node.names
                if a.name.split(".")[0] == "torch" and any(map(_private, a.name.split(".")))
            ]
        elif (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and (_rooted(node.value, roots) or node.attr in owned)
        ):
            found.append(f"{where} .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and _rooted(node.args[0], roots)
        ):
            found.append(f"{where} {node.func.id}(..., {node.args[1].value!r})")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and (
                node.value in owned
                or re.fullmatch(r"torch(\.\w+)+", node.value)
                and any(map(_private, node.value.split(".")))
            )
        ):
            found.append(f"{where} {node.value!r}")
    return found


def _outside_torch_private(check):
    """What ``check(module, tree)`` finds in every module but torch_private."""
    return [hit for m, tree in SOURCES.items() if m != "hmp.core.torch_private" for hit in check(m, tree)]


def test_private_torch_names_only_in_torch_private():
    owned = _owned_private_names()
    assert {"_version", "_enabled", "_flat_weights", "_worker_loop", "_engine_run_backward"} <= owned
    assert _outside_torch_private(lambda m, tree: private_torch_accesses(m, tree, owned)) == []


PLANTED = """
import torch
import torch.utils.checkpoint as ckpt
from torch.utils._pytree import tree_map
from torch.jit import _builtins
a = torch._C.TensorBase
b = ckpt._checkpoint_impl
c = getattr(torch.autograd, "_engine_run_backward", None)
d = t._version
e = "torch._C._nn"
f = torch.nn.functional.linear
"""


def test_the_private_name_check_finds_planted_accesses():
    found = private_torch_accesses("planted", ast.parse(PLANTED), _owned_private_names())
    assert sorted({int(hit.split(" ", 1)[0].split(":")[1]) for hit in found}) == [4, 5, 6, 7, 8, 9, 10], found


TESTS = Path(__file__).resolve().parents[1]
KINDS = ("unit", "property", "integration")  # what runs; helpers/ holds what tests share


def test_tests_are_filed_by_kind():
    top = sorted(p.name for p in TESTS.glob("*.py"))
    assert top == ["conftest.py"], f"test files belong in one of {KINDS}: {top}"
    folders = sorted(p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
    assert folders == sorted(KINDS + ("helpers",)), folders
    assert not list((TESTS / "helpers").glob("test_*.py")), "helpers/ holds no tests"
    for kind in KINDS:
        files = list((TESTS / kind).glob("*.py"))
        assert files and all(p.name.startswith("test_") for p in files), (kind, [p.name for p in files])


def test_tests_import_shared_code_from_helpers_not_conftest():
    offenders = [
        str(p.relative_to(TESTS))
        for p in TESTS.rglob("*.py")
        if any(
            isinstance(n, ast.ImportFrom)
            and n.module == "conftest"
            or isinstance(n, ast.Import)
            and any(a.name == "conftest" for a in n.names)
            for n in ast.walk(ast.parse(p.read_text()))
        )
    ]
    assert not offenders, offenders


def test_public_api_is_annotated_and_marked_typed():
    """Every public function says what it takes and returns (PEP 484), and
    the package says so to type checkers (PEP 561's py.typed marker)."""
    missing = []
    for name in hmp.__all__:
        obj = getattr(hmp, name)
        if isinstance(obj, type):  # disable_casts / enable_casts: context managers without arguments
            continue
        sig = inspect.signature(obj)
        missing += [f"{name}({p})" for p in sig.parameters.values() if p.annotation is inspect.Parameter.empty]
        if sig.return_annotation is inspect.Signature.empty:
            missing.append(f"{name} -> ?")
    assert missing == []
    assert (PACKAGE / "py.typed").is_file()


# what convert() replaces besides op sites, in a process that imported only torch and hmp
_REPLACED = """
import json, hmp
from hmp.binding import wrapper_life
from hmp.core.state import runtime
hmp.convert()
out = []
for e in runtime.undo_log.records():
    if not wrapper_life.is_wrapper(e.value):
        owner = e.namespace.__name__ if isinstance(e.namespace, type(json)) else e.namespace.__qualname__
        out.append([owner, e.attr])
print(json.dumps(out))
"""


def test_every_replacement_outside_op_sites_is_listed():
    """docs/architecture.md lists, with its reason and test, every name
    convert() replaces that is not an op site: a new patch cannot slip in."""
    res = subprocess.run([sys.executable, "-c", _REPLACED], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    replaced = json.loads(res.stdout.strip().splitlines()[-1])
    assert replaced  # the rules do replace some names
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    section = page.split("## What convert() replaces")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    unlisted = [
        f"{owner}.{attr}"
        for owner, attr in replaced
        if not any(f"`{owner}.{attr}`" in row or (f"`{owner}." in row and f"`{attr}`" in row) for row in rows)
    ]
    assert unlisted == [], "add them to docs/architecture.md with their reason and test"


# The floors, bottom up: a module imports from its own floor and those below.
# core is the ground floor: what runs in every call (tested.py and
# version.py are data beside it); binding decides once per convert() what
# the lists say and what each site's wrapper does; diagnostics notes errors
# and other precision machinery; rules install what each rule changes; the
# driver (convert/revert) puts them together; tools, integrations, the demo
# and the package's front door use it.
FLOORS = (
    ("hmp.core", "hmp.tested", "hmp.version"),
    ("hmp.binding",),
    ("hmp.diagnostics",),
    ("hmp.rules",),
    ("hmp.driver",),
    ("hmp.tools", "hmp.integrations", "hmp.demo", "hmp.testing", "hmp.__main__", "hmp"),
)


def floor(module):
    for level, prefixes in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes if p != "hmp"):
            return level
    assert module == "hmp", f"{module} is on no floor: add it to FLOORS"
    return len(FLOORS) - 1


def upward(edges):
    return sorted((m, n) for m, names in edges.items() for n in names if floor(n) > floor(m))


def test_every_module_is_on_a_floor():
    for m in SOURCES:
        floor(m)


def test_core_imports_nothing_above_it():
    assert [(m, n) for m, n in upward(graph()) if floor(m) == 0] == []


def test_no_import_runs_back_up_a_floor():
    assert upward(graph()) == []


def test_the_floor_check_finds_a_planted_upward_import():
    edges = graph()
    edges["hmp.core.policy"] = edges["hmp.core.policy"] | {"hmp.rules.rnn"}
    assert ("hmp.core.policy", "hmp.rules.rnn") in upward(edges)


# On the top floor the package's face (hmp/__init__) and the demo stand above the rest: they import
# tools/ and integrations/, so nothing else imports them (tune reaches the demo by name only, as its
# default TARGET).
def on_top(module):
    return module in ("hmp", "hmp.demo") or module.startswith("hmp.demo.")


def up_on_the_top_floor(edges):
    return sorted((m, n) for m, names in edges.items() for n in names if on_top(n) and not on_top(m))


def test_nothing_below_imports_the_face_or_the_demo():
    assert up_on_the_top_floor(graph()) == []


def test_the_top_floor_check_finds_planted_imports():
    edges = graph()
    edges["hmp.tools.tune_cli"] = edges["hmp.tools.tune_cli"] | {"hmp.demo.training", "hmp"}
    assert up_on_the_top_floor(edges) == [("hmp.tools.tune_cli", "hmp"), ("hmp.tools.tune_cli", "hmp.demo.training")]


def _uses_the_undo_log(tree):
    """True when the module reaches the undo log: ``runtime.undo_log`` (or
    ``rt.undo_log``), or makes a PatchLog."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "undo_log":
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("runtime", "rt"):
                return True
            if isinstance(base, ast.Attribute) and base.attr == "runtime":
                return True
        if isinstance(node, ast.Name) and node.id == "PatchLog":
            return True
    return False


def test_one_owner_writes_the_undo_log():
    # rules and module entries change the process later through ctx.later (the driver's)
    owners = {m for m, tree in SOURCES.items() if _uses_the_undo_log(tree)}
    assert owners == {"hmp.driver.conversion"}


def test_the_undo_log_check_finds_a_planted_writer():
    assert _uses_the_undo_log(ast.parse("runtime.undo_log.setattr(a, 'b', c)"))
    assert _uses_the_undo_log(ast.parse("log = state.runtime.undo_log"))
    assert not _uses_the_undo_log(ast.parse("ctx.later(a, 'b', c)"))


def test_every_rule_has_the_one_interface():
    from hmp import rules

    for rule in rules.RULES:
        public = {n for n, v in vars(rule).items() if callable(v) and getattr(v, "__module__", None) == rule.__name__}
        assert "changes" in public, rule.__name__
        assert not {"hooks", "needs"} & public, f"{rule.__name__}: hooks and what it lacks go in changes()"


# torch's classes hmp meets: a private attribute of theirs is reached only from
# torch_private, whatever the variable that holds the object is called
_TORCH_CLASSES = (
    torch.Tensor,
    torch.nn.Parameter,
    torch.nn.Module,
    torch.nn.RNNBase,
    torch._ops.OpOverload,
    torch._ops.OpOverloadPacket,
    torch.autograd.Function,
    torch.optim.Optimizer,
    torch.amp.GradScaler,
    torch.autocast,
)


def _names_hmp_defines():
    """Attribute names hmp's own code defines: methods and class attributes of
    its classes, and attributes it assigns (``self._found = ...``)."""
    own = set()
    for tree in SOURCES.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        own.add(item.name)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                            if isinstance(target, ast.Name):
                                own.add(target.id)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for el in target.elts if isinstance(target, ast.Tuple) else [target]:
                        if isinstance(el, ast.Attribute):
                            own.add(el.attr)
    return own


def _torch_objects():
    """The classes, and an instance of each (instance attributes: an overload's _schema)."""
    param = torch.nn.Parameter(torch.zeros(1))
    return (
        *_TORCH_CLASSES,
        torch.zeros(1),
        param,
        torch.nn.Linear(1, 1),
        torch.nn.LSTM(1, 1),
        torch.ops.aten.mm.default,
        torch.ops.aten.mm,
        torch.optim.SGD([param], lr=0.1),
        torch.autocast("cpu"),
    )


def torch_class_privates():
    names = {n for obj in _torch_objects() for n in dir(obj) if _private(n) and not n.startswith("__")}
    return names - _names_hmp_defines()


def private_attribute_reads(module, tree, names):
    return [
        f"{module}:{node.lineno} .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in names
    ]


def test_private_attributes_of_torchs_classes_only_in_torch_private():
    names = torch_class_privates()
    assert {"_schema", "_version", "_flat_weights"} <= names
    assert _outside_torch_private(lambda m, tree: private_attribute_reads(m, tree, names)) == []


def test_the_private_attribute_check_finds_one_through_any_variable():
    planted = ast.parse("op = getattr(packet, name)\nschema = op._schema\nv = whatever._version\n")
    assert private_attribute_reads("planted", planted, torch_class_privates()) == [
        "planted:2 ._schema",
        "planted:3 ._version",
    ]


def _subnormal_floats(tree):
    """Lines of hypothesis ``floats(...)`` strategies whose range reaches the
    subnormals (it includes 0, or is unbounded) without ``allow_subnormal=False``."""
    hits = []
    for node in ast.walk(tree):
        func = getattr(node, "func", None)
        if not (isinstance(func, ast.Attribute) and func.attr == "floats" and getattr(func.value, "id", "") == "st"):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        if "allow_subnormal" in kw:
            continue
        bounds = [*node.args[:2], kw.get("min_value"), kw.get("max_value")]
        known = [
            b.value if isinstance(b, ast.Constant) else -b.operand.value if isinstance(b, ast.UnaryOp) else None
            for b in bounds
            if b is not None
        ]
        if len(known) < 2 or any(v is None for v in known) or min(known) <= 0 <= max(known):
            hits.append(node.lineno)
    return hits


def test_hypothesis_floats_leave_out_subnormals():
    # the floor's torch build flushes subnormals to zero for the whole process once loaded, and
    # hypothesis then refuses a strategy that may draw one (CI's floor leg failed that way, twice)
    found = [
        f"{path.relative_to(TESTS)}:{line}"
        for path in sorted(TESTS.rglob("test_*.py"))
        for line in _subnormal_floats(ast.parse(path.read_text()))
    ]
    assert found == []


def test_the_subnormal_check_finds_a_planted_strategy():
    planted = ast.parse(
        "a = st.floats(0.0, 1.0)\nb = st.floats(1e-4, 1.0)\nc = st.floats(-1, 1, allow_subnormal=False)\n"
    )
    assert _subnormal_floats(planted) == [1]


def test_architecture_names_each_packages_modules_in_its_row():
    """docs/architecture.md's table of folders names every module of each
    package in that package's row, and no module the package lacks: the map
    agrees with the code after a move."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    stems = {p.stem for p in PACKAGE.rglob("*.py")}  # every module's name, to tell module names in a row
    for folder in ("core", "binding", "diagnostics", "rules", "driver"):
        row = next(line for line in page.splitlines() if line.startswith(f"| `hmp/{folder}/` |"))
        named = set(re.findall(r"`([a-z_]+)`", row.split(" | ")[-1]))
        modules = {p.stem for p in (PACKAGE / folder).glob("*.py") if p.stem != "__init__"}
        assert modules - named == set(), f"hmp/{folder}/ modules missing from docs/architecture.md"
        assert {n for n in named if n in stems} - modules == set(), f"hmp/{folder}/'s row names another's"


def _identifiers(root):
    """Every name token in the Python files under ``root``."""
    names = set()
    for path in root.rglob("*.py"):
        with open(path, "rb") as f:
            names |= {t.string for t in tokenize.tokenize(f.readline) if t.type == tokenize.NAME}
    return names


def test_the_names_table_names_what_the_code_defines():
    """docs/architecture.md's table of names with one meaning: every identifier
    it cites (`runtime.undo_log`, `cache._CacheEntry`, `on_import`) is a name in
    hmp's code, so a rename that leaves the table behind fails here."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    table = page.split("## Names with one meaning", 1)[1].split("\n## ", 1)[0]
    cited = {m.rstrip("()").split(".")[-1] for m in re.findall(r"`([A-Za-z_][\w.]*(?:\(\))?)`", table)}
    cited -= {"binding", "kinds", "py"}  # parts of paths the table cites
    assert len(cited) > 20
    assert sorted(cited - _identifiers(PACKAGE)) == []
