"""The cpu set's directories whose modules a run imports: scripts/stacks/cpu-bytecode.txt.

bootstrap.sh byte-compiles only these for a run (with PYTHONDONTWRITEBYTECODE set, as in many
images, an uncompiled module is compiled again in every process that imports it); the rest of
the set (anthropic's and openai's clients, transformers' other models, ...: ~55% of its
bytecode, 25-27 s on 2 cores) only with --test-overlays, for the tests. A directory missing from
the list costs speed, never correctness: its modules are then compiled in memory.

Made by recording a run: Python writes every module a process imports under one prefix, Ray's
workers and vLLM's processes included (they inherit the environment), then this lists the
site-packages directories found there, relative to site-packages ('.' for its top level):

    PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=/tmp/run_pyc \\
        bash scripts/train_mcore.sh --ckpt-dir /tmp/record --steps 5
    .venv/bin/python -m scripts.stacks.bytecode_dirs /tmp/run_pyc > scripts/stacks/cpu-bytecode.txt

`python scripts/stacks/bytecode_dirs.py compile` (bootstrap.sh's "bytecode" stage) compiles them.

Record again when cpu.lock changes (tests/scripts/test_bytecode_dirs.py fails on a listed
directory the installed set lacks).
"""

import compileall
import sys
import sysconfig
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

LIST = Path(__file__).with_name("cpu-bytecode.txt")


def recorded_dirs(prefix: Path, site: Path) -> list[str]:
    """The directories under `site` that hold a module some process imported, as the bytecode
    under PYTHONPYCACHEPREFIX=`prefix` mirrors them (prefix + the source's absolute path)."""
    mirror = prefix / site.resolve().relative_to("/")
    if not mirror.is_dir():
        raise SystemExit(f"bytecode_dirs: nothing of {site} was recorded under {prefix}")
    dirs = {pyc.parent.relative_to(mirror).as_posix() for pyc in mirror.rglob("*.pyc")}
    return sorted(dirs)


def listed() -> list[str]:
    """cpu-bytecode.txt's directories."""
    return [line for line in LIST.read_text().splitlines() if line and not line.startswith("#")]


def compile_listed(site: Path, workers: int | None = None) -> tuple[int, int]:
    """Byte-compile the modules of the listed directories (not their subdirectories) under
    `site`, in one pool of `workers` processes (compileall's -j makes a pool a directory: 12 s
    of pool starts over 1,232 directories). Returns (modules, failed): a module that does not
    compile (a template, another Python's syntax) is skipped, as pip does; a listed directory
    the set lacks too."""
    files = [
        str(f) for d in listed() if (site / d).is_dir() for f in sorted((site / d).glob("*.py"))
    ]
    with ProcessPoolExecutor(workers) as pool:
        compiled = sum(pool.map(_compile, files, chunksize=64))
    return len(files), len(files) - compiled


def _compile(path: str) -> bool:
    return bool(compileall.compile_file(path, quiet=2))


def main(argv: list[str]) -> int:
    site = Path(sysconfig.get_paths()["purelib"])
    if argv == ["compile"]:
        modules, failed = compile_listed(site)
        print(f"{modules} modules of {len(listed())} directories, {failed} not compiled")
        return 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(recorded_dirs(Path(argv[0]), site)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
