"""The project's import graph: no circles, and imports run one way down the floors
scripts -> recipes -> converters -> parallel -> backend. Read from the source with `ast`:
every import statement, module level or inside a function, relative ones resolved, and
`from pkg import sub` counted as an import of pkg.sub when sub is a module."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_mcore  # reads source, imports nothing of the project

FLOORS = ("backend", "parallel", "converters", "recipes", "scripts")  # bottom first
ROOT = Path(__file__).resolve().parent.parent


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> its file, for every .py under the floors (a package: __init__)."""
    files = {}
    for floor in FLOORS:
        for path in sorted((root / floor).rglob("*.py")) if (root / floor).is_dir() else ():
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement reaches (a module, or a name inside one)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    prefix = node.module or ""
    if node.level:  # relative: from this module's package, up level - 1 packages
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = package[: len(package) - node.level + 1]
        prefix = ".".join(base + ([node.module] if node.module else []))
    return [f"{prefix}.{alias.name}" for alias in node.names]


def import_graph(root: Path) -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    """module -> {module of ours it imports: line of the first such import}, and the files."""
    files = module_files(root)
    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported(node, module, path.name == "__init__.py"):
                while name and name not in files:  # a name inside a module: that module
                    name = name.rpartition(".")[0]
                if name and name != module:  # "": not ours (stdlib, third party)
                    edges.setdefault(name, node.lineno)
    return graph, files


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import circles: strongly connected components of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def circle_lines(root: Path) -> list[str]:
    graph, files = import_graph(root)
    return [
        "import circle among " + ", ".join(str(files[m].relative_to(root)) for m in circle)
        for circle in circles(graph)
    ]


def upward_lines(root: Path) -> list[str]:
    graph, files = import_graph(root)

    def floor(module: str) -> int:
        return FLOORS.index(module.partition(".")[0])

    return [
        f"{files[module].relative_to(root)}:{line}: {module} imports {target}, "
        f"a floor above it ({' < '.join(FLOORS)})"
        for module, edges in sorted(graph.items())
        for target, line in sorted(edges.items())
        if floor(target) > floor(module)
    ]


def test_no_import_circles():
    found = circle_lines(ROOT)
    assert not found, "\n".join(found)


def test_imports_run_down_the_floors():
    found = upward_lines(ROOT)
    assert not found, "\n".join(found)


def _tree(root: Path, sources: dict[str, str]) -> Path:
    for name, text in sources.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_checker_names_a_planted_circle_and_upward_import(tmp_path):
    root = _tree(tmp_path, {
        "backend/__init__.py": "",
        "backend/a.py": "import os\nfrom backend import b\n",  # `from pkg import sub`
        "backend/b.py": "def f():\n    from .a import x\n",  # relative, inside a function
        "backend/c.py": "X = 1\n\n\ndef g():\n    import parallel.p\n",
        "parallel/__init__.py": "",
        "parallel/p.py": "from backend.b import f\n",  # downward: fine
    })  # fmt: skip
    assert circle_lines(root) == ["import circle among backend/a.py, backend/b.py"]
    assert upward_lines(root) == [
        "backend/c.py:5: backend.c imports parallel.p, a floor above it "
        "(backend < parallel < converters < recipes < scripts)"
    ]


def test_the_checker_passes_a_tree_without_either(tmp_path):
    root = _tree(tmp_path, {
        "backend/__init__.py": "from backend.a import x\n",
        "backend/a.py": "x = 1\n",
        "converters/__init__.py": "",
        "converters/t.py": "from ..backend import a\nimport torch\n",
    })  # fmt: skip
    graph, _ = import_graph(root)
    assert graph["converters.t"] == {"backend.a": 1}
    assert circle_lines(root) == [] and upward_lines(root) == []
