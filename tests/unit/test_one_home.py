"""Every concept in the file named after it (issue 50): each has one home,
where its names are defined, and no other module defines them again."""

import ast
import inspect
from pathlib import Path

import hmp
from hmp.core import kinds
from hmp.driver import plan

PACKAGE = Path(hmp.__file__).parent

# concept's home (a module path under hmp/) -> the names only it defines
HOMES = {
    "core/module_entries.py": {
        "is_module_path",
        "module_class",
        "is_pattern",
        "Pattern",
        "entry_key",
        "class_path",
        "from_line",
        "targets",
        "merge",
        "shown",
        "resolved",
    },
    "core/identity.py": {"mark", "unwrap", "stand_in", "ORIGINAL"},
    "core/kinds.py": {"Kind", "KINDS", "kind", "Fallback", "OPT_LEVELS"},
    "core/pays.py": {"why_not", "decision", "is_pointwise", "is_random", "NORMALIZATIONS"},
    "driver/plan.py": {"plan", "requested", "options_of", "PARAMETERS"},
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
    (tmp_path / "core").mkdir()
    planted = "class Pattern:\n    pass\n\n\ndef outer():\n    def class_path(c):\n        pass\n"
    (tmp_path / "core" / "lists.py").write_text(planted)
    assert second_homes(tmp_path) == [
        ("core/lists.py", "Pattern", "core/module_entries.py"),
        ("core/lists.py", "class_path", "core/module_entries.py"),
    ]


KIND_NAMES = {"bf16", "fp32", "promote"}  # the public names of the list kinds (hmp/core/kinds.py)


def kind_tables(root):
    """``[(module, line)]`` for every dict keyed by, or tuple, list or set
    holding, two or more list kinds' names under ``root``, outside
    core/kinds.py: a second table of kinds, which a new kind would miss."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = path.relative_to(root).as_posix()
        if module == "core/kinds.py":
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
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "kinds.py").write_text('NAMES = ("bf16", "fp32", "promote")\n')
    assert kind_tables(tmp_path) == [("tools/svg.py", 1), ("tools/svg.py", 5)]


def test_convert_options_are_spelled_once_in_its_signature():
    """plan() and the integrations take convert()'s options by name, read from
    its signature: none of them spells an option of its own."""
    options = set(inspect.signature(hmp.convert).parameters)
    assert set(plan.PARAMETERS) == options
    assert not options & set(inspect.signature(plan.plan).parameters)
    assert set(plan.requested("O2", strict=True)) == {"opt_level", "strict"}
    try:
        from hmp.integrations.lightning import HMPFSDPPrecision, HMPPrecision
    except ImportError:  # lightning is an extra
        return
    for plugin in (HMPPrecision, HMPFSDPPrecision):
        assert not options & set(inspect.signature(plugin.__init__).parameters), plugin
