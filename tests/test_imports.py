"""The project's import graph: no circles, and imports run one way down the floors
scripts -> recipes -> converters -> parallel -> backend; inside recipes/, down its rooms
(RECIPE_ROOMS): the launcher over the embedded CPU run (local) over the cluster path (dapo),
so dapo never imports local, nor either the launcher. Read from the source with `ast`:
every import statement, module level or inside a function, relative ones resolved, and
`from pkg import sub` counted as an import of pkg.sub when sub is a module."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_mcore  # reads source, imports nothing of the project

FLOORS = ("backend", "parallel", "converters", "recipes", "scripts")  # bottom first
# recipes' subpackages, bottom first; a module belongs to the longest room naming it (the
# modules directly in recipes/dapo and recipes/local are rooms of their own)
RECIPE_ROOMS = (
    "recipes",
    "recipes.dapo",  # BACKEND, the actor's plan limit, LaunchError
    "recipes.dapo.job",  # verl's overrides, fit, trainer modes, which actor
    "recipes.dapo.checkpoints",  # files, background saves, resume as data
    "recipes.dapo.engine",  # what runs in verl's workers
    "recipes.dapo.cluster",  # processes, Ray, nodes, the run's scope
    "recipes.dapo.console",  # what a person sees
    "recipes.local.cpu",  # verl's CPU platform, vLLM's CPU build as a rollout
    "recipes.local.task",  # the tasks, the built models
    "recipes.local",  # the embedded run: overrides, warm-up, export, finish
    "recipes.launcher",  # arguments -> RunSpec -> the cluster run or the embedded one
)
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


def room(module: str) -> str:
    """The recipes room a recipes module belongs to."""
    return max((r for r in RECIPE_ROOMS if module == r or module.startswith(r + ".")), key=len)


def upward_room_lines(root: Path) -> list[str]:
    graph, files = import_graph(root)
    rank = {r: i for i, r in enumerate(RECIPE_ROOMS)}
    return [
        f"{files[module].relative_to(root)}:{line}: {module} imports {target}, a recipes room "
        f"above its own ({room(module)} < {room(target)} in RECIPE_ROOMS)"
        for module, edges in sorted(graph.items())
        if module.startswith("recipes")
        for target, line in sorted(edges.items())
        if target.startswith("recipes") and rank[room(target)] > rank[room(module)]
    ]


def test_no_import_circles():
    found = circle_lines(ROOT)
    assert not found, "\n".join(found)


def test_imports_run_down_the_floors():
    found = upward_lines(ROOT)
    assert not found, "\n".join(found)


def test_recipes_import_down_their_rooms():
    """dapo <-> local and package-level circles inside recipes/ show up here first."""
    found = upward_room_lines(ROOT)
    assert not found, "\n".join(found)


def test_every_recipes_package_has_a_room():
    packages = sorted({m for m in import_graph(ROOT)[1] if m.startswith("recipes")
                       and (ROOT / m.replace(".", "/") / "__init__.py").is_file()})  # fmt: skip
    assert packages == sorted(RECIPE_ROOMS)


def test_the_checker_names_an_upward_room_import(tmp_path):
    root = _tree(tmp_path, {
        "recipes/__init__.py": "",
        "recipes/dapo/__init__.py": "",
        "recipes/dapo/cluster/__init__.py": "",
        "recipes/dapo/cluster/ray_job.py": "def f():\n    from recipes.local import overrides\n",
        "recipes/local/__init__.py": "",
        "recipes/local/overrides.py": "from recipes.dapo.cluster.ray_job import f\n",
    })  # fmt: skip
    assert upward_room_lines(root) == [
        "recipes/dapo/cluster/ray_job.py:2: recipes.dapo.cluster.ray_job imports "
        "recipes.local.overrides, a recipes room above its own (recipes.dapo.cluster < "
        "recipes.local in RECIPE_ROOMS)"
    ]


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
