"""recipes.local.import_closure: the code the warm-up's cache key covers."""

from recipes.local.import_closure import reachable
from recipes.local.warmup_cache import CODE_ROOTS


def _tree(tmp_path, files: dict[str, str]):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_every_kind_of_reference_is_followed(tmp_path):
    """A module's top-level, lazy (in a function) and relative imports, a `from package import
    submodule`, and a config target named in a string are all reached, with their packages;
    a module nothing names is not. Bug caught: a warm-up reused after a change to code it ran
    (its engine is named only in verl's config: a string)."""
    repo = _tree(tmp_path, {
        "recipes/__init__.py": "",
        "recipes/a.py": "import backend.b\ndef f():\n    from recipes import c\n",
        "recipes/c.py": "from .d import x\nTARGET = 'parallel.e.Config'\n",
        "recipes/d.py": "x = 1\n",
        "recipes/unused.py": "import parallel.f\n",
        "backend/__init__.py": "", "backend/b.py": "import torch\n",
        "parallel/__init__.py": "", "parallel/e.py": "", "parallel/f.py": "",
    })  # fmt: skip
    found = reachable(("recipes.a",), repo)
    assert set(found) == {
        "recipes", "recipes.a", "recipes.c", "recipes.d", "backend", "backend.b", "parallel",
        "parallel.e",
    }  # fmt: skip
    assert found["recipes.d"] == repo / "recipes" / "d.py"


def test_the_warm_ups_code_is_what_it_runs_not_the_whole_tree():
    """The warm-up's process, engine, platform and export reach the engine, the converters
    and parallel/ (which the key missed before); the launcher, the run's finish and the
    summary are not its code (a change there threw a 2-minute warm-up away)."""
    found = reachable(CODE_ROOTS)
    for needed in ("recipes.dapo.engine.verl_engine", "recipes.dapo.engine.config",
                   "backend.model", "converters.convert", "parallel.plan",
                   "recipes.local.cpu.platform"):  # fmt: skip
        assert needed in found, needed
    for other in ("recipes.local.run", "recipes.local.export_ahead", "recipes.local.summary",
                  "recipes.launcher", "recipes.local.cpu.vllm_plugin"):  # fmt: skip
        assert other not in found, other
