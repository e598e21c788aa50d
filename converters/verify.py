"""Compare checkpoints tensor by tensor, or one checkpoint against its manifest.

Either side may be an HF dir or a megatron-core dist checkpoint; both are seen in the HF
hub namespace (per-expert keys), a dist checkpoint one parameter at a time, so memory stays
at a parameter or two whatever the model size. Each mismatch is one line.
"""

from collections.abc import Callable
from pathlib import Path

import torch

from backend.model.families import load_spec
from converters.convert import load_spec_for, read_param, table
from converters.dist_read import DistReader, find_dist_dir, is_dist_dir
from converters.errors import ConversionError
from converters.hf_source import HFSource
from converters.manifest import (
    NAME,
    dtype_name,
    manifest_problems,
    read_manifest,
    sha256,
    write_manifest,
)
from converters.pickles.safe_pickle import METADATA, check_dist_checkpoint, refusals
from converters.table import split_row

CHUNK = 1 << 24  # elements compared at a time under --atol


class HFSide:
    def __init__(self, path: Path):
        self.src = HFSource(path)
        self.spec_source = path

    def names(self) -> list[str]:
        return list(self.src.entries)

    def get(self, name: str) -> torch.Tensor:
        return self.src[name]


class DistSide:
    """HF-named view of a dist checkpoint; parameters assembled on demand, last one cached."""

    def __init__(self, path: Path, config):
        from converters.dist_layout import build_layout

        self.reader = DistReader(path)
        self.spec, _ = load_spec_for(self.reader, config, None)
        self.layout = build_layout(self.spec, torch.float32)
        self.rows = table(self.spec)
        self.owner = {h: name for name, (_, hf) in self.rows.items() for h in hf}
        self._cached: tuple[str | None, dict] = (None, {})

    def names(self) -> list[str]:
        return list(self.owner)

    def param(self, name: str) -> torch.Tensor:
        self.layout.dtype = self.reader.dtype(self.layout.pieces[name][0].key)
        return read_param(self.reader, self.layout, name)

    def get(self, hf_name: str) -> torch.Tensor:
        name = self.owner[hf_name]
        if self._cached[0] != name:
            row, hf = self.rows[name]
            self._cached = (
                name,
                dict(zip(hf, split_row(row, self.param(name), self.spec), strict=True)),
            )
        return self._cached[1][hf_name]


def open_side(path: str | Path, config) -> HFSide | DistSide:
    path = Path(path)
    if not path.exists():
        raise ConversionError(f"{path} does not exist: pass an HF dir or a dist checkpoint dir")
    return DistSide(path, config) if is_dist_dir(path) else HFSide(path)


def diff(name: str, a: torch.Tensor, b: torch.Tensor, atol: float | None) -> str | None:
    """One line describing how b differs from a, or None."""
    if tuple(a.shape) != tuple(b.shape):
        return f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if atol is None:
        if a.dtype != b.dtype:
            return f"{name}: dtype {dtype_name(a.dtype)} vs {dtype_name(b.dtype)} (pass --atol to compare values)"
        same = torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
        return None if same else f"{name}: not bit-exact, max abs diff {_max_diff(a, b):.3g}"
    worst = _max_diff(a, b)
    return None if worst <= atol else f"{name}: max abs diff {worst:.3g} > atol {atol:g}"


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b, worst = a.reshape(-1), b.reshape(-1), 0.0
    for i in range(0, a.numel(), CHUNK):  # chunks: no fp64 copy of a whole embedding
        d = (a[i : i + CHUNK].double() - b[i : i + CHUNK].double()).abs()
        worst = max(worst, float(d.nan_to_num(float("inf")).max()) if d.numel() else 0.0)
    return worst


def refused_pickles(path, report: Callable[[str], None]) -> tuple[int, bool]:
    """What resume and mcore-to-hf would refuse to unpickle in a dist checkpoint (its
    `.metadata`, `common.pt`, byte items: converters.pickles.safe_pickle), each reported as one line:
    (how many, whether its tensors can still be read, i.e. `.metadata` passed)."""
    if not is_dist_dir(path):
        return 0, True
    found = list(refusals(find_dist_dir(path)))
    for _, err in found:
        report(str(err))
    return len(found), not any(p.name == METADATA for p, _ in found)


def compare(
    a_path, b_path, *, atol: float | None = None, config=None, report: Callable[[str], None] = print
) -> tuple[int, int]:
    """(tensors compared, mismatches); each mismatch is reported as one line, and so is each
    pickle a side holds that is not plain data (its tensors are not compared when that is
    `.metadata`, through which they are found)."""
    refused = [refused_pickles(p, report) for p in (a_path, b_path)]
    if not all(readable for _, readable in refused):
        return 0, sum(n for n, _ in refused)
    config = config or _hf_config(a_path, b_path)
    a, b = open_side(a_path, config), open_side(b_path, config)
    if isinstance(a, HFSide) and isinstance(b, DistSide):  # walk the dist side in model order
        a, b, swap = b, a, True
    else:
        swap = False
    names_b = set(b.names())
    compared, mismatches = 0, sum(n for n, _ in refused)
    for name in a.names():
        if name not in names_b:
            report(f"{name}: only in {b_path if swap else a_path}")
            mismatches += 1
            continue
        names_b.discard(name)
        x, y = (b.get(name), a.get(name)) if swap else (a.get(name), b.get(name))
        line = diff(name, x, y, atol)
        compared += 1
        if line:
            report(line)
            mismatches += 1
    for name in sorted(names_b):
        report(f"{name}: only in {a_path if swap else b_path}")
        mismatches += 1
    return compared, mismatches


def _hf_config(*paths) -> Path | None:
    """A dist side is read with the config of the HF side, when there is one."""
    for p in map(Path, paths):
        if (p / "config.json").is_file() and not is_dist_dir(p):
            load_spec(p)
            return p
    return None


def check_manifest(path, *, config=None, report: Callable[[str], None] = print) -> tuple[int, int]:
    """Every file's bytes and every tensor's sha256 against the checkpoint's manifest.json, and
    every pickle of a dist checkpoint through the allow-lists (a crafted file with a manifest
    that agrees is still a finding): (files and tensors checked, mismatches), each mismatch
    reported as one line."""
    path = Path(path)
    root = find_dist_dir(path) if is_dist_dir(path) else path
    manifest = read_manifest(root)
    checked = bad = 0
    if "files" in manifest:
        problems = manifest_problems(root)
        checked, bad = len(manifest["files"]), len(problems)
        for line in problems:
            report(line)
    refused, readable = refused_pickles(path, report)
    bad += refused
    if "tensors" in manifest and readable:
        n, m = _check_tensors(path, manifest["tensors"], config, report)
        checked, bad = checked + n, bad + m
    return checked, bad


def _check_tensors(
    path: Path, entries: dict, config, report: Callable[[str], None]
) -> tuple[int, int]:
    side = open_side(path, config)
    present = set(side.layout.shapes) if isinstance(side, DistSide) else set(side.names())
    checked = bad = 0
    for name, want in entries.items():
        if name not in present:
            report(f"{name}: in manifest, missing from {path}")
            bad += 1
            continue
        tensor = side.param(name) if isinstance(side, DistSide) else side.get(name)
        have = {
            "sha256": sha256(tensor),
            "shape": list(tensor.shape),
            "dtype": dtype_name(tensor.dtype),
        }
        checked += 1
        for field in ("shape", "dtype", "sha256"):
            if have[field] != want[field]:
                report(f"{name}: {field} {have[field]} vs manifest {want[field]}")
                bad += 1
                break
    for name in sorted(present - set(entries)):
        report(f"{name}: not in the manifest")
        bad += 1
    return checked, bad


def write_trusted_manifest(path, *, force: bool = False) -> Path:
    """manifest.json (every file's sha256) for a checkpoint the user vouches for, e.g. a
    training save made without one; a dist checkpoint is checked to hold only data first."""
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"{path} is not a directory: pass a checkpoint directory")
    dist = is_dist_dir(path)
    root = find_dist_dir(path) if dist else path
    if (root / NAME).exists() and not force:
        raise ConversionError(
            f"{root / NAME} exists: pass --force to replace it, or verify against it"
        )
    if dist:
        check_dist_checkpoint(root)
    return write_manifest(root, "mcore-torch_dist" if dist else "hf-safetensors")
