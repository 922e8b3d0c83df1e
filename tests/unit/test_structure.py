"""The package's shape, checked from its source: no import cycle, state in
one leaf module written by conversion.py only, imports at the top, module
names no public function shadows, and one wrapper body for every kind of
wrapper."""

import ast
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hmp
from hmp import wrap

PACKAGE = Path(hmp.__file__).resolve().parent
# optional or platform-only modules may be imported where they are needed
LOCAL_IMPORTS_ALLOWED = {"matplotlib", "matplotlib.pyplot", "resource"}


def module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


PATHS = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
SOURCES = {m: ast.parse(p.read_text(), str(p)) for m, p in PATHS.items()}


def imported(module, tree):
    """``[(node, name of what it imports, at module level?)]``: hmp modules by
    their full name, other imports by what they name."""
    package = module if PATHS[module].name == "__init__.py" else module.rpartition(".")[0]
    top = set(map(id, tree.body))
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
    return {m: {name for _, name, _ in imported(m, tree) if name in SOURCES and name != m}
            for m, tree in SOURCES.items()}


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


def test_state_is_a_leaf():
    assert graph()["hmp.state"] == set()
    assert not [name for _, name, _ in imported("hmp.state", SOURCES["hmp.state"]) if name.startswith("hmp")]


def test_imports_are_at_module_level():
    local = [f"{m}:{node.lineno} {name}" for m, tree in SOURCES.items() for node, name, top in imported(m, tree)
             if not top and name not in LOCAL_IMPORTS_ALLOWED
             and not (isinstance(node, ast.Import) and all(a.name in LOCAL_IMPORTS_ALLOWED for a in node.names))]
    assert local == []


def test_only_conversion_writes_the_runtime():
    writers = set()
    for m, tree in SOURCES.items():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                while isinstance(t, (ast.Attribute, ast.Subscript)):
                    t = t.value
                    if isinstance(t, ast.Name) and t.id in ("runtime", "rt") or \
                            isinstance(t, ast.Attribute) and t.attr == "runtime":
                        writers.add(m)
    assert writers == {"hmp.conversion"}


def test_no_public_name_shadows_a_module():
    shadowed = [name for name in dir(hmp) if f"hmp.{name}" in SOURCES
                and not isinstance(getattr(hmp, name), types.ModuleType)]
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
            for fn in (F.linear, torch.Tensor.mul, torch.Tensor.__iadd__, torch.softmax, Square.apply, user_fn,
                       hmp.op_wrap(torch.relu, hmp.to_bf16)):
                bodies.add(fn.__code__)
            assert user_fn(torch.ones(2)).dtype == torch.bfloat16
    finally:
        hmp.unregister(Square, "apply")
    assert bodies == {wrap._BODY}
    # paused while not converted: the decorated function is a plain call
    assert user_fn.__code__ is not wrap._BODY and user_fn(torch.ones(2)).dtype == torch.float32


@pytest.mark.parametrize("name", sorted(m.rpartition(".")[2] for m in SOURCES if m.count(".") == 1))
def test_module_is_importable_under_its_name(name):
    assert isinstance(__import__(f"hmp.{name}", fromlist=["_"]), types.ModuleType)


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
    offenders = [str(p.relative_to(TESTS)) for p in TESTS.rglob("*.py")
                 if any(isinstance(n, ast.ImportFrom) and n.module == "conftest" or
                        isinstance(n, ast.Import) and any(a.name == "conftest" for a in n.names)
                        for n in ast.walk(ast.parse(p.read_text())))]
    assert not offenders, offenders
