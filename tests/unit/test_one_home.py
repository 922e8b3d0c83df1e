"""Every concept in the file named after it (issue 50): each has one home,
where its names are defined, and no other module defines them again."""

import ast
import inspect
from pathlib import Path

import hmp
from hmp.binding import kinds
from hmp.driver import plan

PACKAGE = Path(hmp.__file__).parent

# concept's home (a module path under hmp/) -> the names only it defines
HOMES = {
    "binding/module_entries.py": {
        "is_module_path",
        "module_class",
        "is_pattern",
        "Pattern",
        "entry_key",
        "class_path",
        "from_line",
        "from_parameter",
        "merge",
        "shown",
        "resolved",
    },
    "core/identity.py": {"mark", "unwrap", "stand_in", "ORIGINAL"},
    "binding/kinds.py": {"Kind", "KINDS", "kind", "Fallback", "OPT_LEVELS"},
    "binding/pays.py": {"why_not", "decision", "is_pointwise", "is_random", "NORMALIZATIONS"},
    "driver/plan.py": {"plan", "requested", "options_of", "PARAMETERS"},
    # what a wrapper wraps, for the error path (was Wrapped, beside sites.Wrappers); the paused wrapper
    "core/rescue.py": {"About"},
    "core/wrap.py": {"PAUSED"},
}


def defined(path):
    """Every name ``path`` defines: functions and classes at any depth, and module-level assignments."""
    tree = ast.parse(path.read_text())
    names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def second_homes(root):
    """``[(module, name, its home)]`` for every name of HOMES defined outside its home under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = path.relative_to(root).as_posix()
        names = defined(path)
        for home, owned in HOMES.items():
            if module != home:
                found += [(module, name, home) for name in sorted(names & owned)]
    return found


def test_each_concepts_names_are_defined_in_its_home_only():
    for home, owned in HOMES.items():
        assert owned <= defined(PACKAGE / home), home
    assert second_homes(PACKAGE) == []


def test_a_planted_second_home_is_caught(tmp_path):
    (tmp_path / "binding").mkdir()
    planted = "class Pattern:\n    pass\n\n\ndef outer():\n    def class_path(c):\n        pass\n"
    (tmp_path / "binding" / "lists.py").write_text(planted)
    assert second_homes(tmp_path) == [
        ("binding/lists.py", "Pattern", "binding/module_entries.py"),
        ("binding/lists.py", "class_path", "binding/module_entries.py"),
    ]


KIND_NAMES = {"bf16", "fp32", "promote"}  # the public names of the list kinds (hmp/binding/kinds.py)


def kind_tables(root):
    """``[(module, line)]`` for every dict keyed by, or tuple, list or set
    holding, two or more list kinds' names under ``root``, outside
    binding/kinds.py: a second table of kinds, which a new kind would miss."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = path.relative_to(root).as_posix()
        if module == "binding/kinds.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                items = node.keys
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                items = node.elts
            else:
                continue
            named = {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}
            if len(named & KIND_NAMES) >= 2:
                found.append((module, node.lineno))
    return found


def test_the_list_kinds_have_one_table():
    assert set(kinds.names()) == KIND_NAMES
    assert kind_tables(PACKAGE) == []


def test_a_planted_second_table_of_kinds_is_caught(tmp_path):
    (tmp_path / "tools").mkdir()
    planted = (
        'COLOURS = {"bf16": "#1b9e77", "fp32": "#7570b3"}\n\n\ndef f(kind):\n    return kind in ("promote", "bf16")\n'
    )
    (tmp_path / "tools" / "svg.py").write_text(planted)
    (tmp_path / "binding").mkdir()
    (tmp_path / "binding" / "kinds.py").write_text('NAMES = ("bf16", "fp32", "promote")\n')
    assert kind_tables(tmp_path) == [("tools/svg.py", 1), ("tools/svg.py", 5)]


# where a kind's public name comes in from outside hmp's own structures, which carry the record
NAMES_COME_IN = {
    "driver/user.py": "register()'s kind argument",
    "testing/checking.py": "effective_lists()' keys, the public answer the check reads",
}


def name_lookups(root):
    """``[(module, line)]`` for each ``kinds.kind(...)`` call under ``root`` outside kinds.py."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            func = getattr(node, "func", None) if isinstance(node, ast.Call) else None
            if isinstance(func, ast.Attribute) and func.attr == "kind" and getattr(func.value, "id", None) == "kinds":
                found.append((module, node.lineno))
    return [(m, n) for m, n in found if m != "binding/kinds.py"]


def test_a_kinds_name_becomes_its_record_only_where_it_comes_in():
    """Conversions, rules, tools and the testing kit carry kinds.Kind records; ``kinds.kind(name)``
    runs only where a name comes in."""
    assert {m for m, _ in name_lookups(PACKAGE)} <= set(NAMES_COME_IN), name_lookups(PACKAGE)


def test_a_planted_name_lookup_is_caught(tmp_path):
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "t.py").write_text("from hmp.binding import kinds\n\nk = kinds.kind('fp32')\n")
    assert name_lookups(tmp_path) == [("tools/t.py", 3)]


def test_convert_options_are_spelled_once_in_its_signature():
    """plan() takes convert()'s options as one Requested, whose fields and defaults are convert()'s
    parameters and defaults, in order; the integrations read them from its signature: none of them
    spells an option of its own."""
    parameters = inspect.signature(hmp.convert).parameters
    assert list(plan.Requested._fields) == list(parameters)
    assert plan.Requested._field_defaults == {name: p.default for name, p in parameters.items()}
    options = set(parameters)
    assert set(plan.PARAMETERS) == options
    assert not options & set(inspect.signature(plan.plan).parameters)
    assert set(plan.requested("O2", strict=True)) == {"opt_level", "strict"}
    try:
        from hmp.integrations.lightning import HMPFSDPPrecision, HMPPrecision
    except ImportError:  # lightning is an extra
        return
    for plugin in (HMPPrecision, HMPFSDPPrecision):
        assert not options & set(inspect.signature(plugin.__init__).parameters), plugin


def module_stores(root):
    """``{"module.name"}`` for every module-level mutable store (a dict, list or set literal, a
    weak container) and every lru_cache'd function under ``root``, outside core/state.py."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() == "core/state.py":
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                v = node.value
                container = isinstance(v, (ast.Dict, ast.List, ast.Set)) or (
                    isinstance(v, ast.Call)
                    and ast.unparse(v.func).split(".")[-1] in ("set", "dict", "list", "WeakKeyDictionary", "WeakSet")
                )
                empty = container and not any(getattr(v, f, None) for f in ("keys", "elts", "args", "keywords"))
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    # a table written at import is a constant (UPPER_CASE, not empty); an empty one is filled later
                    if isinstance(t, ast.Name) and container and t.id != "__all__" and (empty or not t.id.isupper()):
                        found.add(f"{path.stem}.{t.id}")
            elif isinstance(node, ast.FunctionDef) and any("lru_cache" in ast.unparse(d) for d in node.decorator_list):
                found.add(f"{path.stem}.{node.name}")
    return found


def unmarked_stores(root):
    """The stores and memos ``module_stores`` finds under ``root`` whose definition does not say
    why it is kept: a ``# kept: why`` line right above it (above its decorators, for a memo)."""
    missing = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() == "core/state.py":
            continue
        lines = path.read_text().split("\n")
        stores = module_stores_in(path, root)
        for name, first in stores:
            above = lines[first - 2].strip() if first >= 2 else ""
            if not (above.startswith("# kept: ") and len(above) > len("# kept: ") + 3):
                missing.append(name)
    return sorted(missing)


def module_stores_in(path, root):
    """``[(name, first line)]`` of ``module_stores``' finds in one file (its decorators' line, for a memo)."""
    found = module_stores(root)
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name) and f"{path.stem}.{t.id}" in found:
                    out.append((f"{path.stem}.{t.id}", node.lineno))
        elif isinstance(node, ast.FunctionDef) and f"{path.stem}.{node.name}" in found:
            out.append((f"{path.stem}.{node.name}", min([d.lineno for d in node.decorator_list] or [node.lineno])))
    return out


def test_what_hmp_keeps_outside_state_says_why_where_it_is_kept():
    """core/state.py holds what hmp keeps between calls; each store or memo kept elsewhere says
    why with a ``# kept:`` line where it is defined (a marker this test reads, not a list kept by
    hand). A table written at import (an UPPER_CASE name holding a non-empty literal) is a
    constant, not a store."""
    assert unmarked_stores(PACKAGE) == [], "kept outside core/state.py without a '# kept: why' line above it"


def rebound_globals(root):
    """``[(path, line)]`` of every ``global`` statement under ``root``: a module-level name a
    function rebinds is a store no docstring check sees (a store belongs on core/state.py)."""
    return [
        (path.relative_to(root).as_posix(), node.lineno)
        for path in sorted(root.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Global)
    ]


def test_no_function_rebinds_a_module_name():
    assert rebound_globals(PACKAGE) == []


def test_a_planted_global_is_caught(tmp_path):
    (tmp_path / "core").mkdir()
    planted = "_ready = False\n\n\ndef ready():\n    global _ready\n    _ready = True\n"
    (tmp_path / "core" / "wrap.py").write_text(planted)
    assert rebound_globals(tmp_path) == [("core/wrap.py", 5)]


def test_a_planted_store_outside_state_is_caught(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "cache.py").write_text(
        "import functools\nseen = {}\nTABLE = {1: 2}\nLATER = []\n\n@functools.lru_cache\ndef f(x):\n    return x\n"
    )
    assert module_stores(tmp_path) == {"cache.seen", "cache.LATER", "cache.f"}
    assert unmarked_stores(tmp_path) == ["cache.LATER", "cache.f", "cache.seen"]
    marked = "import functools\n# kept: a planted memo\n@functools.lru_cache\ndef f(x):\n    return x\n"
    (tmp_path / "core" / "cache.py").write_text(marked)
    assert module_stores(tmp_path) == {"cache.f"} and unmarked_stores(tmp_path) == []


def classes_named_twice(root):
    """``{class name: [modules]}`` for every class name defined in more than one module under ``root``:
    a class is a concept, and one name for two of them is read as the wrong one (issue 58)."""
    where = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(path.relative_to(root).as_posix())
    return {name: modules for name, modules in where.items() if len(set(modules)) > 1}


def test_each_class_name_means_one_thing():
    assert classes_named_twice(PACKAGE) == {}


def test_a_planted_second_class_of_a_name_is_caught(tmp_path):
    (tmp_path / "binding").mkdir()
    (tmp_path / "testing").mkdir()
    (tmp_path / "binding" / "imports.py").write_text("class Watch:\n    pass\n")
    (tmp_path / "testing" / "plugin.py").write_text("class Watch:\n    pass\n")
    assert classes_named_twice(tmp_path) == {"Watch": ["binding/imports.py", "testing/plugin.py"]}
