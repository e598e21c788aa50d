"""docs/code_map.md is the generator's output for the tree as it is (scripts/code_map.py: every
module of the product packages, its docstring's first line, by folder), and the generator
groups, describes, refuses a module without a docstring and spots a stale page."""

from pathlib import Path

import pytest

from scripts.code_map import PACKAGES, STALE, main, render

pytestmark = pytest.mark.no_mcore  # reads source with ast, imports nothing of megatron-core

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "code_map.md"


def _modules(root: Path) -> list[Path]:
    return [
        p.relative_to(root)
        for package in PACKAGES
        for p in sorted((root / package).rglob("*.py"))
        if "__pycache__" not in p.parts
    ]


def test_the_page_is_fresh():
    assert PAGE.read_text() == render(ROOT), (
        "docs/code_map.md is stale: run `python -m scripts.code_map` and commit the page"
    )


def test_every_product_module_is_on_the_page():
    text = PAGE.read_text()
    sections = {}  # folder -> its section's text
    for chunk in text.split("\n#")[1:]:
        heading, _, body = chunk.lstrip("#").strip().partition("\n")
        sections[heading] = body
    missing = [
        rel.as_posix()
        for rel in _modules(ROOT)
        if rel.name != "__init__.py"
        and f"- `{rel.name}`: " not in sections.get(f"{rel.parent}/", "")
    ]
    assert not missing, f"not on docs/code_map.md: {missing}"
    folders = {f"{rel.parent}/" for rel in _modules(ROOT)}
    assert folders <= set(sections), f"folders without a section: {folders - set(sections)}"


def _plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


PLANTED = {
    "backend/__init__.py": '"""The bottom floor."""\n',
    "backend/zeta.py": '"""Last by name. A second sentence,\nnot listed.\n\nMore text."""\nX = 1\n',
    "backend/alpha.py": '"""\n    First by name (a docstring opening on its second line)."""\n',
    "backend/notes.txt": "not Python: not listed\n",
    "backend/model/__init__.py": '"""The model."""\n',
    "backend/model/build.py": "'''Build it.'''\n",
    "backend/model/__pycache__/build.py": "no docstring, but skipped\n",
    "parallel/__init__.py": '"""Plans."""\n',
    "parallel/__main__.py": "import sys\n",
    "scripts/tool.py": '"""A script in a folder without __init__.py."""\n',
}


def test_render_groups_and_describes(tmp_path):
    text = render(_plant(tmp_path, PLANTED))
    assert text[text.index("## backend/") :] == (
        "## backend/\n\n"
        "The bottom floor.\n"
        "- `alpha.py`: First by name (a docstring opening on its second line).\n"
        "- `zeta.py`: Last by name.\n\n"
        "### backend/model/\n\n"
        "The model.\n"
        "- `build.py`: Build it.\n\n"
        "## parallel/\n\n"
        "Plans.\n"
        "- `__main__.py`: `python -m parallel`\n\n"
        "## scripts/\n\n"
        "- `tool.py`: A script in a folder without __init__.py.\n"
    )
    assert "python -m scripts.code_map" in text and "tests/test_code_map.py" in text


def test_a_module_without_docstring_exits_2(tmp_path, capsys):
    root = _plant(tmp_path, {**PLANTED, "parallel/plan.py": "# a comment, no docstring\n"})
    assert main([], root=root) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "parallel/plan.py" in err and "add a one-line docstring" in err
    assert not (root / "docs" / "code_map.md").exists()


def test_check_spots_a_stale_page(tmp_path, capsys):
    root = _plant(tmp_path, PLANTED)
    assert main(["--check"], root=root) == 1  # no page yet
    assert main([], root=root) == 0
    page = root / "docs" / "code_map.md"
    assert page.read_text() == render(root)
    assert [p.name for p in page.parent.iterdir()] == ["code_map.md"]  # no temporary left over
    assert main(["--check"], root=root) == 0
    (root / "backend" / "model" / "heads.py").write_text('"""A new module."""\n')
    capsys.readouterr()
    assert main(["--check"], root=root) == 1
    assert capsys.readouterr().err == STALE + "\n"
