"""The repository's modules a module can reach, read from the sources (nothing imported).

The warm-up cache keys a warm-up by the code it runs (recipes.local.warmup_cache): the modules
reachable from its entry points, so that a change to the launcher, the finish or the rollout
does not throw away a warm-up, and a change anywhere the warm-up reaches (parallel/ too) does.
Reachable: every import statement of a module, wherever it is (a function's lazy import
counts), each package on the way, and every string constant that names one of the
repository's modules (verl's config targets: `_target_`, `external_lib`). It over-approximates
what a process imports, never under: a module reached only through a computed name is missed,
so entry points name those.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("backend", "parallel", "converters", "recipes")  # this repository's top level


def reachable(roots: tuple[str, ...], repo: Path = REPO) -> dict[str, Path]:
    """{module name: its source file} of every repository module reachable from `roots`."""
    found: dict[str, Path] = {}
    todo = list(roots)
    while todo:
        parts = todo.pop().split(".")
        if parts[0] not in PACKAGES:
            continue
        for depth in range(1, len(parts) + 1):  # each package on the way, then the module
            name = ".".join(parts[:depth])
            source = _source(repo, name)
            if source is None or name in found:
                continue
            found[name] = source
            package = name if source.name == "__init__.py" else name.rpartition(".")[0]
            todo.extend(_names(source, package))
    return found


def _source(repo: Path, name: str) -> Path | None:
    path = repo.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None  # a class or function of a module, or nothing of ours


def _names(source: Path, package: str):
    """Dotted names a module's source refers to (imports, and strings that may be modules)."""
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + [base] if base else up)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)  # a submodule, maybe
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            parts = node.value.split(".")
            if parts[0] in PACKAGES and all(p.isidentifier() for p in parts):
                yield node.value
