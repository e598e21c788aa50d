"""The docs hold together: every relative Markdown link and every `path#anchor` in README.md,
docs/*.md and the packages' README.md files resolves (a file, and for an anchor a heading with
that GitHub slug); every docs page fits in MAX_LINES; README.md lists every docs page; and a
code comment citing a page (`docs/x.md, "Section"`) names an existing page and heading."""

import os
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 250
# generated, one line a module: its length follows the tree (scripts/code_map.py)
GENERATED_INDEXES = {"code_map.md"}
SKIP_DIRS = {"runs", "node_modules", "__pycache__"}  # and every dot-dir (.venv, .git, ...)
CODE_DIRS = ("backend", "parallel", "converters", "recipes", "scripts", "tests")

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
CODE_ANCHOR = re.compile(r"`([\w./-]+\.md)#([\w-]+)`")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
# a page cited from code: `docs/x.md`, optionally with `, "Section"` (a comment may wrap the
# line between them: "# " at the start of the next line is skipped)
CITE = re.compile(
    r"(?<![\w/.-])(docs/[\w.-]+\.md|(?:backend|parallel|converters|recipes|scripts|tests)"
    r"/(?:[\w.-]+/)*README\.md)(?:,?\s*(?:#\s*)?\"([^\"]+)\")?"
)


def markdown_files(repo: Path = REPO) -> list[Path]:
    """README.md, docs/*.md and every README.md below the repository root."""
    found = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    for top, dirs, files in os.walk(repo):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        if Path(top) != repo and "README.md" in files:
            found.append(Path(top) / "README.md")
    return found


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline markup dropped, lower case, punctuation removed
    (letters, digits, '_', '-' and spaces kept), spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file, repeats numbered as GitHub does (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def headings(path: Path) -> list[str]:
    """The headings' plain text (no inline markup)."""
    out = []
    for _, line in _prose_lines(path.read_text()):
        match = HEADING.match(line)
        if match:
            out.append(match.group(2).replace("`", "").replace("*", ""))
    return out


def _check(source: Path, number: int, target: str, bases: list[Path], repo: Path) -> str | None:
    """None when target (`path`, `path#anchor` or `#anchor`) resolves from one of bases."""
    path, _, anchor = target.partition("#")
    if not path:
        candidates = [source]
    else:
        candidates = [(base / path).resolve() for base in bases]
    where = f"{source.relative_to(repo)}:{number}"
    existing = [c for c in candidates if c.exists()]
    if not existing:
        return f"{where}: {target}: no such file"
    if anchor and not any(c.suffix == ".md" and anchor in anchors(c) for c in existing):
        return f"{where}: {target}: no heading with the anchor #{anchor}"
    return None


def broken_links(path: Path, repo: Path = REPO) -> list[str]:
    """Every relative link and `path#anchor` of a Markdown file that does not resolve, as
    'file:line: target: why'. Links resolve from the file's folder; a `path#anchor` in inline
    code from the file's folder or from the repository root."""
    problems = []
    for number, line in _prose_lines(path.read_text()):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if SCHEME.match(target) or target.startswith("<"):
                continue
            problems.append(_check(path, number, target, [path.parent], repo))
        for file, anchor in CODE_ANCHOR.findall(line):
            problems.append(_check(path, number, f"{file}#{anchor}", [path.parent, repo], repo))
    return [p for p in problems if p]


def broken_citations(path: Path, repo: Path = REPO) -> list[str]:
    """Pages cited in a code file (`docs/x.md`, `recipes/README.md, "Section"`) that do not
    exist, or none of whose headings starts with the cited section. Only this repository's
    pages count: docs/<page>.md and the packages' README.md files."""
    problems = []
    text = path.read_text(errors="replace")
    for match in CITE.finditer(text):
        cited, section = match.group(1), match.group(2)
        number = text.count("\n", 0, match.start()) + 1
        where = f"{path.relative_to(repo)}:{number}"
        page = repo / cited
        if not page.exists():
            problems.append(f"{where}: {cited}: no such file")
        elif section and not any(
            h.lower().startswith(" ".join(re.sub(r"\n\s*#", " ", section).split()).lower())
            for h in headings(page)
        ):
            problems.append(f'{where}: {cited}: no heading "{section}"')
    return problems


def code_files(repo: Path = REPO) -> list[Path]:
    out = []
    for name in CODE_DIRS:
        for top, dirs, files in os.walk(repo / name):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
            out += [
                Path(top) / f for f in sorted(files) if f.endswith((".py", ".sh", ".in", ".txt"))
            ]
    return [p for p in out if p != Path(__file__).resolve()]


def test_every_link_and_anchor_resolves():
    files = markdown_files()
    assert REPO / "docs" / "cpu_run.md" in files and REPO / "recipes" / "README.md" in files
    problems = [p for path in files for p in broken_links(path)]
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_short():
    long = {
        p.name: n
        for p in (REPO / "docs").glob("*.md")
        if p.name not in GENERATED_INDEXES and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"docs pages over {MAX_LINES} lines: {long}"


def test_the_readme_lists_every_docs_page():
    readme = REPO / "README.md"
    listed = {
        (REPO / target.partition("#")[0]).resolve()
        for _, line in _prose_lines(readme.read_text())
        for target in LINK.findall(line)
    }
    missing = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in listed]
    assert not missing, f"README.md links no entry for: {missing}"


def test_code_cites_existing_pages_and_sections():
    problems = [p for path in code_files() for p in broken_citations(path)]
    assert not problems, "\n".join(problems)


def test_a_broken_link_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## Pipeline parallelism (`--pp`)\n")
    good = "[p](docs/page.md#pipeline-parallelism---pp) `docs/page.md#a-page` [web](https://x.y)"
    (tmp_path / "README.md").write_text(
        f"# Top\n\n{good}\n\n```\n[not a link](docs/nope.md)\n```\n\n"
        "[gone](docs/gone.md) [anchor](docs/page.md#nope) `docs/page.md#nope2` [self](#top)\n"
    )
    problems = broken_links(tmp_path / "README.md", repo=tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "docs/gone.md: no such file",
        "docs/page.md#nope: no heading with the anchor #nope",
        "docs/page.md#nope2: no heading with the anchor #nope2",
    ]
    assert all(p.startswith("README.md:9: ") for p in problems)


def test_a_stale_citation_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## A lost node\n")
    code = tmp_path / "x.py"
    code.write_text(
        '# (docs/page.md, "A lost node") docs/page.md\n'
        '# under a minute (docs/page.md,\n# "A lost\n# node")\n'
        '# (docs/page.md, "Gone") (docs/old.md)\n'
    )
    assert broken_citations(code, repo=tmp_path) == [
        'x.py:5: docs/page.md: no heading "Gone"',
        "x.py:5: docs/old.md: no such file",
    ]


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("Pipeline parallelism (`--pp`)", "pipeline-parallelism---pp"),
        ("The routing report's page", "the-routing-reports-page"),
        ("At Qwen3-30B-A3B size", "at-qwen3-30b-a3b-size"),
        ("Ours (`recipes/dapo/`)", "ours-recipesdapo"),
        ("One box, two raylets", "one-box-two-raylets"),
        ("`npu`: Ascend A2, CANN 8.3.RC1", "npu-ascend-a2-cann-83rc1"),
    ],
)
def test_slug_is_githubs(heading, anchor):
    assert slug(heading) == anchor
