"""scripts/stacks/bytecode_dirs.py: the directories a run imports, which the bootstrap compiles."""

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from scripts.stacks.bytecode_dirs import listed, recorded_dirs

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

REPO = Path(__file__).resolve().parents[2]


def test_a_recorded_process_lists_the_directories_it_imported_from(tmp_path):
    """A real interpreter under PYTHONPYCACHEPREFIX, importing json and email.mime.text from the
    standard library (purelib's stand-in: the same mirroring): exactly their directories.
    Bug caught: listing __pycache__ folders, or paths the bootstrap cannot prefix."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prefix = tmp_path / "pyc"
    subprocess.run(
        [sys.executable, "-c", "import json.decoder, email.mime.text"], check=True,
        env={"PYTHONPYCACHEPREFIX": str(prefix), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    dirs = recorded_dirs(prefix, stdlib)
    assert {"json", "email", "email/mime"} <= set(dirs)
    assert "." in dirs  # the top level's modules (re, enum, ...)
    assert not any("__pycache__" in d or d.startswith("/") for d in dirs)
    assert "xml/dom" not in dirs  # not imported
    with pytest.raises(SystemExit, match="nothing of .* was recorded"):
        recorded_dirs(tmp_path / "empty", stdlib)


def test_every_listed_directory_is_in_the_installed_set():
    """Bug caught: cpu.lock moved on and the list names directories the new set lacks (its
    modules then compiled in every process). Record it again: the module's docstring says how."""
    site = Path(sysconfig.get_paths()["purelib"])
    if not (site / "vllm").is_dir() or sys.prefix != str(REPO / ".venv"):
        pytest.skip("the cpu set's .venv only")
    dirs = listed()
    assert len(dirs) > 500 and dirs == sorted(set(dirs))
    missing = [d for d in dirs if not (site / d).is_dir()]
    assert not missing, f"{len(missing)} listed directories are not installed, e.g. {missing[:3]}"
    for package in ("torch", "vllm", "verl", "megatron/core", "ray", "transformers"):
        assert package in dirs


def test_compile_takes_the_listed_directories_alone(tmp_path, monkeypatch):
    """The bootstrap's stage: every module of a listed directory compiled, not its
    subdirectories' (not listed: a run does not import them), a module that does not compile
    and a listed directory the set lacks skipped, counted. Bug caught: the whole tree compiled
    again (36 s), or one bad file failing the bootstrap."""
    from importlib.util import cache_from_source

    from scripts.stacks import bytecode_dirs

    site = tmp_path / "site"
    (site / "pkg" / "sub").mkdir(parents=True)
    for name, text in {"pkg/a.py": "x = 1\n", "pkg/bad.py": "def (:\n", "pkg/sub/b.py": "y = 2\n",
                       "top.py": "z = 3\n"}.items():  # fmt: skip
        (site / name).write_text(text)
    listing = tmp_path / "list.txt"
    listing.write_text("# recorded\n.\npkg\nmissing\n")
    monkeypatch.setattr(bytecode_dirs, "LIST", listing)
    assert bytecode_dirs.compile_listed(site, workers=2) == (3, 1)
    compiled = {p: Path(cache_from_source(str(site / p))).is_file()
                for p in ("top.py", "pkg/a.py", "pkg/bad.py", "pkg/sub/b.py")}  # fmt: skip
    assert compiled == {"top.py": True, "pkg/a.py": True, "pkg/bad.py": False,
                        "pkg/sub/b.py": False}  # fmt: skip
