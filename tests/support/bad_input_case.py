"""A row of tests/support/bad_inputs.py (`Case`) and the scratch it is made in (`Ctx`)."""

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Case:
    cli: str  # converters | parallel | launcher | ray_node | monitor | resolve
    what: str
    setup: Callable  # ctx -> argv
    code: int
    message: str
    stream: str = "err"
    # ctx -> Python source run as the launcher's training child (the real run_command and
    # output handling; a stand-in for verl's trainer that runs the engine's own check)
    child: Callable | None = None


@dataclass
class Ctx:
    tmp: Path
    hf: Path
    mcore: Path

    def copy(self, src: Path, name: str, drop: str | None = None) -> Path:
        ignore = shutil.ignore_patterns(drop) if drop else None
        return Path(shutil.copytree(src, self.tmp / name, ignore=ignore))

    def edit_json(self, path: Path, **changes) -> Path:
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
        return path

    def flip(self, path: Path, at: int, count: int = 16) -> Path:
        raw = bytearray(path.read_bytes())
        for i in range(at, at + count):
            raw[i] ^= 0xFF
        path.write_bytes(bytes(raw))
        return path
