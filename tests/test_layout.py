"""The tree's layout rules: no product folder holds more than MAX_MODULES modules directly,
scripts/ runs as packages (no sys.path.insert), tests/ mirrors the product packages, and no
product file is longer than MAX_FILE_LINES."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.no_mcore  # reads files, imports nothing of the project

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("backend", "parallel", "converters", "recipes", "scripts")
MAX_MODULES = 20  # modules directly in one folder, besides __init__.py and __main__.py
MAX_FILE_LINES = 400


def folder_sizes(root: Path) -> dict[str, int]:
    sizes = {}
    for top in PRODUCT:
        for folder in [root / top, *sorted((root / top).rglob("*"))]:
            if folder.is_dir() and "__pycache__" not in folder.parts:
                modules = [p for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")]
                sizes[folder.relative_to(root).as_posix()] = len(modules)
    return sizes


def test_no_product_folder_holds_more_than_20_modules():
    crowded = {f: n for f, n in folder_sizes(ROOT).items() if n > MAX_MODULES}
    assert not crowded, f"split these folders by concern: {crowded}"


def test_the_check_counts_a_crowded_folder(tmp_path):
    (tmp_path / "recipes" / "dapo").mkdir(parents=True)
    for i in range(MAX_MODULES + 1):
        (tmp_path / "recipes" / "dapo" / f"m{i}.py").write_text("")
    (tmp_path / "recipes" / "dapo" / "__init__.py").write_text("")
    assert folder_sizes(tmp_path)["recipes/dapo"] == MAX_MODULES + 1


def test_scripts_are_packages_without_path_hacks():
    """`python -m scripts.bench.NAME`: every folder of scripts/ with Python is a package and
    none of its files edits sys.path (a bare sibling import would need it)."""
    files = sorted((ROOT / "scripts").rglob("*.py"))
    hacks = [p.relative_to(ROOT).as_posix() for p in files if "sys.path.insert" in p.read_text()]
    assert not hacks
    folders = {p.parent for p in files}
    assert all((f / "__init__.py").is_file() for f in folders), sorted(map(str, folders))


def test_tests_mirror_the_product_packages():
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {*PRODUCT, "support", "data"}
    loose = sorted(p.name for p in (ROOT / "tests").glob("*.py"))
    # repo-wide checks (imports, layout, docs, code map, every CLI's bad inputs) stay at the root
    assert loose == ["__init__.py", "conftest.py", "test_bad_inputs.py", "test_code_map.py",
                     "test_docs.py", "test_imports.py", "test_layout.py"]  # fmt: skip


def test_product_files_are_short():
    long = {
        p.relative_to(ROOT).as_posix(): n
        for top in PRODUCT
        for p in (ROOT / top).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"over {MAX_FILE_LINES} lines: {long}"
