"""No import circle anywhere in the course: common/, the lesson folders (scripts, workers, solutions),
benchmarks/, trainer/ and troubleshooting/ (the tests are not course code).

The graph is read with `ast`, so it holds every import statement, also those inside functions: a circle
closed by a function-level import (errors.run importing get_rank from distributed, which imports errors)
fails only when that function runs, and is still a circle in the design.
"""
import ast
from pathlib import Path

from lessons import ROOT

PACKAGES = ("common", "benchmarks", "trainer")  # imported as `common.x`, `benchmarks.x`, `trainer.x`
SCRIPT_DIRS = ("troubleshooting", *sorted(p.name for p in ROOT.glob("0[0-9]_*") if p.is_dir()))


def course_modules() -> dict[str, Path]:
    """{node: file}. Package modules are named as imported (common.data, benchmarks.report, common for
    __init__.py); a script is `folder/stem`: its folder is on sys.path when it runs, so its siblings import
    it by stem."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    for folder in SCRIPT_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            modules[str(path.relative_to(ROOT).with_suffix(""))] = path
    return modules


def imports_of(node: str, path: Path, modules: dict) -> set[str]:
    """The course modules `path` imports, anywhere in the file."""
    package = node.rpartition(".")[0] if node.split(".")[0] in PACKAGES else None
    script_dir = None if package is not None or node in PACKAGES else str(Path(node).parent)

    def resolve(name: str) -> set[str]:
        found = set()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
            dotted = ".".join(parts[:i])
            if dotted in modules:
                found.add(dotted)
        if script_dir is not None and len(parts) == 1 and f"{script_dir}/{name}" in modules:
            found.add(f"{script_dir}/{name}")
        return found

    found = set()
    for stmt in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                found |= resolve(alias.name)
        elif isinstance(stmt, ast.ImportFrom):
            base = stmt.module or ""
            if stmt.level:  # relative: only inside a package
                anchor = node if path.stem == "__init__" else package
                anchor = ".".join(anchor.split(".")[: len(anchor.split(".")) - stmt.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            found |= resolve(base)
            for alias in stmt.names:  # `from common import data` imports the module common.data
                found |= {m for m in resolve(f"{base}.{alias.name}") if m == f"{base}.{alias.name}"}
    found.discard(node)  # a file naming itself (a docstring example aside) is not a circle of modules
    return found


def graph() -> dict[str, set[str]]:
    modules = course_modules()
    return {node: imports_of(node, path, modules) for node, path in modules.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_top_level_and_function_level_imports():
    edges = graph()
    assert "common.exits" in edges["04_ddp_training/mnist_ddpmodel"] and "common.exits" in edges["trainer.ddp"]
    assert "common.distributed" in edges["common.exits"]
    assert "common.download" in edges["common.data"] and "common.files" in edges["common.config"]
    assert len(edges) > 40, sorted(edges)


def test_no_import_circle_in_the_course():
    found = circles(graph())
    assert not found, "import circles (each group imports itself through the others): " + "; ".join(
        " <-> ".join(group) for group in found)


def test_the_circle_finder_finds_a_circle_closed_inside_a_function(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    modules = {"d/a": tmp_path / "a.py", "d/b": tmp_path / "b.py"}
    edges = {node: imports_of(node, path, modules) for node, path in modules.items()}
    assert circles(edges) == [["d/a", "d/b"]]
