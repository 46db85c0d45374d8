"""The package's imports flow one way: no import circle between modules, no private name imported across
modules, and no lower layer importing a higher one. Walks every module's source (imports inside functions
count; those under `if TYPE_CHECKING:` are type-only and do not)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import flowrl
from flowrl.dsl.dag import strongly_connected

PACKAGE = Path(flowrl.__file__).resolve().parent
# Lower layers first; a module may import from its own layer and the ones before it. (cli is the top.)
LAYERS = [
    ("flowrl.errors",),
    ("flowrl.ir", "flowrl.algos", "flowrl.elastic", "flowrl.planner", "flowrl.models", "flowrl.data"),
    ("flowrl.registry", "flowrl.rewards", "flowrl.envs", "flowrl.engines", "flowrl.dsl", "flowrl.passes"),
    ("flowrl.compiler",),
    ("flowrl.runtime",),
    ("flowrl.backends", "flowrl.viz"),
    ("flowrl", "flowrl.cli", "flowrl.__main__"),
]


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = ["flowrl", *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):  # follows the dsl/ and backends/ links
        found[module_name(path)] = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return found


def _type_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_only(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def edges(mods: dict[str, ast.Module]) -> dict[str, set[str]]:
    """module -> the flowrl modules it imports (`from pkg import sub` counts as importing `pkg.sub`)."""
    out: dict[str, set[str]] = {m: set() for m in mods}
    for name, tree in mods.items():
        for node in imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            out[name].update(t for t in targets if t in mods and t != name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (the compiler's Tarjan, dsl/dag.py)."""
    deps = {v: sorted(w for w in graph[v] if w in graph) for v in sorted(graph)}
    return sorted(sorted(comp) for comp in strongly_connected(deps) if len(comp) > 1)


def layer(module: str) -> int:
    best, rank = "", len(LAYERS)
    for i, names in enumerate(LAYERS):
        for prefix in names:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, rank = prefix, i
    return rank


def test_no_import_circle_between_modules() -> None:
    assert cycles(edges(modules())) == []


def test_no_private_name_is_imported_across_modules() -> None:
    mods = modules()
    crossing = []
    for name, tree in mods.items():
        for node in imports(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flowrl"):
                crossing += [f"{name}: from {node.module} import {a.name}" for a in node.names
                             if a.name.startswith("_") and not a.name.startswith("__")]
    assert crossing == []


def test_imports_go_down_the_layers() -> None:
    mods = modules()
    upward = [f"{m} ({layer(m)}) imports {t} ({layer(t)})" for m, targets in edges(mods).items() for t in targets
              if layer(t) > layer(m)]
    assert upward == []


def test_every_module_has_a_layer() -> None:
    assert [m for m in modules() if layer(m) == len(LAYERS)] == []


def test_the_walk_sees_a_circle_and_a_private_import() -> None:
    """The checks above can fail: a made-up circle and a private import are found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("from flowrl.x import _y\nif TYPE_CHECKING:\n    from flowrl.z import w\n")
    assert [n.module for n in imports(tree)] == ["flowrl.x"]
