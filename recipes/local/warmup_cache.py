"""The SFT warm-up kept once by its content, in a cache beside the run directories.

A warm-up is deterministic for the same base model (every file of it: config, weights from
the seed, tokenizer), the same SFT corpus, the same steps and settings (warmup.WARMUP), the
same code (the repository modules its process and its export reach:
recipes.local.import_closure from CODE_ROOTS) and the same library releases (torch,
megatron-core, verl, transformers). `warmup_key` hashes all of them. An entry,
`<cache>/<key>/`, is the exported HF model with a manifest of every file's sha256
(converters.manifest); a run reuses it only after every byte matches, and makes it again
otherwise (a damaged entry is never trained from).
The cache is `<the run directory's parent>/.warmup_cache` (runs/.warmup_cache by default), or
MCORE_DAPO_WARMUP_CACHE; it is safe to move or delete: a run then warms up again.
"""

import hashlib
import json
import os
import shutil
from importlib import metadata
from pathlib import Path

from recipes.local.import_closure import REPO, reachable

CACHE_ENV = "MCORE_DAPO_WARMUP_CACHE"
CACHE_NAME = ".warmup_cache"
# the warm-up's entry points: its process (its engine through verl's registry, the CPU platform
# through VERL_USE_EXTERNAL_MODULES) and its export; verl's trainer aside (its release is keyed)
CODE_ROOTS = ("recipes.local.warmup", "recipes.dapo.engine.verl_engine",
              "recipes.local.cpu.platform", "recipes.local.export")  # fmt: skip
RELEASES = ("torch", "megatron-core", "verl", "transformers")


def cache_root(out: Path) -> Path:
    return Path(os.environ.get(CACHE_ENV) or out.parent / CACHE_NAME).expanduser()


def warmup_key(base: Path, sft_data: Path, steps: int, settings: dict) -> str:
    """16 hex digits of the sha256 of everything that decides the warm-up's result."""
    h = hashlib.sha256()
    for path in sorted(p for p in base.iterdir() if p.is_file()):
        _add(h, f"base/{path.name}", path)
    _add(h, "corpus", sft_data)
    h.update(json.dumps({**settings, "steps": steps}, sort_keys=True).encode())
    for path in sorted(reachable(CODE_ROOTS).values()):
        _add(h, path.relative_to(REPO).as_posix(), path)
    for name in RELEASES:
        h.update(f"{name}=={_release(name)}\n".encode())
    return h.hexdigest()[:16]


def lookup(root: Path, key: str, say=print) -> Path | None:
    """The cached warm-up of `key`, checked byte for byte against its manifest; None when
    there is none, or when it was damaged (then removed, and said so)."""
    from converters.manifest import verify_manifest

    entry = root / key
    if not entry.is_dir():
        return None
    try:
        verify_manifest(entry)
    except (ValueError, OSError) as e:  # ManifestError, CheckpointError, unreadable files
        first = (str(e).splitlines() or [type(e).__name__])[0]
        say(f"warm-up: the cached one in {entry} does not match its manifest ({first}); "
            "making it again")  # fmt: skip
        shutil.rmtree(entry, ignore_errors=True)
        return None
    return entry


def keep(root: Path, key: str, made: Path) -> Path:
    """`made` copied into the cache as `key`, with its manifest, whole or not at all."""
    from converters.manifest import write_manifest

    entry = root / key
    tmp = root / f".{key}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(made, tmp)
    write_manifest(tmp, kind="warm-up", key=key)
    try:
        os.replace(tmp, entry)
    except OSError:  # another run kept the same warm-up meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return entry


def copy_out(entry: Path, final: Path) -> Path:
    """The cached model as the run's own directory (`final`), whole or not at all."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(entry, tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def _add(h, label: str, path: Path) -> None:
    h.update(label.encode() + b"\0")
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    h.update(b"\0")


def _release(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"
