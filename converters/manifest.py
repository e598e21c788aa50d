"""manifest.json: sha256 of every file of a checkpoint, and of every tensor a converter wrote.

`files` covers every file but the manifest: a whole-file sha256, or for a torch_dist data
file (`.distcp`) one per DCP item ([offset, length, sha256], tiling the file), so a reader
that reads items in any order checks each as it reads it (`ChunkHashes`), with no second
pass. `write_manifest(dir)` / `verify_manifest(dir)` do it for any checkpoint directory
(training checkpoints); the converters hash their outputs while writing them (`HashingStream`).

Hashing runs on worker threads (hashlib releases the GIL), overlapping the disk writes:
one per spare core, up to 4 (sha256 runs at ~2 GB/s per core, about a disk's speed).
At most `max_pending` bytes wait for them, which bounds the memory they can hold: 256 MB
(~0.13 s of hashing) keeps the reads ahead as well as 512 MB did, with ~0.3 GB less RSS.
"""

import hashlib
import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from backend.shared.errors import CheckpointError
from converters.errors import ConversionError

NAME = "manifest.json"
VERSION = 2  # 2: `files` added (1: tensors only)
DATA_SUFFIX = ".distcp"
READ_STEP = 8 << 20


class ManifestError(CheckpointError):
    """A checkpoint's bytes differ from its manifest.json, or it has no usable manifest."""


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order (as safetensors stores them)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(tensor)).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class ManifestWriter:
    def __init__(self, kind: str, max_pending: int = 256 << 20):
        self.kind = kind
        workers = max(1, min(4, (os.cpu_count() or 2) - 1))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="sha256")
        self._entries: dict[str, tuple[list[int], str, Future]] = {}
        self._room = threading.Condition()
        self._pending, self._max = 0, max_pending

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        with self._room:  # a single huge tensor still passes when nothing else is pending
            self._room.wait_for(lambda: self._pending == 0 or self._pending + size <= self._max)
            self._pending += size
        future = self._pool.submit(self._hash, tensor, size)
        self._entries[name] = (list(tensor.shape), dtype_name(tensor.dtype), future)

    def _hash(self, tensor: torch.Tensor, size: int) -> str:
        try:
            return sha256(tensor)
        finally:
            with self._room:
                self._pending -= size
                self._room.notify_all()

    def write(self, out_dir: Path, hashed: dict[str, dict] | None = None, **info) -> None:
        """manifest.json in out_dir: the tensors, and every file (`hashed`: the entries of
        files hashed while they were written; the others are read and hashed here)."""
        tensors = {
            name: {"sha256": f.result(), "shape": shape, "dtype": dtype}
            for name, (shape, dtype, f) in self._entries.items()
        }
        self._pool.shutdown()
        files = scan_files(Path(out_dir), hashed or {})
        _write_json(
            Path(out_dir) / NAME,
            {"version": VERSION, "format": self.kind, **info, "files": files, "tensors": tensors},
        )

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def read_manifest(ckpt_dir: Path) -> dict:
    path = Path(ckpt_dir) / NAME
    if not path.is_file():
        raise ConversionError(
            f"no {NAME} in {ckpt_dir}: only converter outputs carry one; compare two checkpoints instead"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{path} is not valid JSON ({err}): re-run the conversion") from err


# ---- files ------------------------------------------------------------------------------


class HashingStream:
    """An output file that hashes what passes through it: the whole file, or the byte ranges
    between `begin()` and `end()` (a DCP item each)."""

    def __init__(self, stream):
        self.stream = stream
        self._whole = hashlib.sha256()
        self._range: hashlib._Hash | None = None
        self._start = 0

    def write(self, data) -> int:
        self._whole.update(data)
        if self._range is not None:
            self._range.update(data)
        return self.stream.write(data)

    def tell(self) -> int:
        return self.stream.tell()

    def flush(self) -> None:
        self.stream.flush()

    def begin(self) -> None:
        self._start, self._range = self.stream.tell(), hashlib.sha256()

    def end(self) -> list:
        """[offset, length, sha256] of the bytes written since begin()."""
        item = [self._start, self.stream.tell() - self._start, self._range.hexdigest()]
        self._range = None
        return item

    def file_entry(self) -> dict:
        return {"size": self.stream.tell(), "sha256": self._whole.hexdigest()}


def _sha256_range(f, offset: int, length: int) -> str:
    digest, done = hashlib.sha256(), 0
    f.seek(offset)
    while done < length:
        block = f.read(min(READ_STEP, length - done))
        if not block:
            break
        digest.update(block)
        done += len(block)
    return digest.hexdigest() if done == length else ""


def hash_file(path: Path) -> dict:
    with open(path, "rb") as f:
        return {
            "size": os.fstat(f.fileno()).st_size,
            "sha256": _sha256_range(f, 0, os.fstat(f.fileno()).st_size),
        }


def item_ranges(root: Path) -> dict[str, list[tuple[int, int]]]:
    """Per data file of a torch_dist checkpoint, its DCP items' (offset, length), sorted."""
    from converters.pickles.safe_pickle import load_metadata

    ranges: dict[str, list[tuple[int, int]]] = {}
    for info in load_metadata(root / ".metadata").storage_data.values():
        ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
    return {name: sorted(set(r)) for name, r in ranges.items()}


def _tiling(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The ranges plus the gaps between them, so that every byte of the file is in one."""
    out, at = [], 0
    for offset, length in ranges:
        if offset > at:
            out.append((at, offset - at))
        out.append((offset, length))
        at = max(at, offset + length)
    return out + ([(at, size - at)] if size > at else [])


def hash_data_file(path: Path, ranges: list[tuple[int, int]]) -> dict:
    size = path.stat().st_size
    with open(path, "rb") as f:
        chunks = [[o, n, _sha256_range(f, o, n)] for o, n in _tiling(ranges, size)]
    return {"size": size, "chunks": chunks}


def file_names(root: Path) -> list[str]:
    """Every file below root but the manifest, as manifest keys (sorted)."""
    names = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return sorted(n for n in names if n != NAME)


def file_entries(root: Path, names: list[str]) -> dict[str, dict]:
    """Manifest entries of these files of root (a torch_dist data file: one chunk per item)."""
    ranges = item_ranges(root) if any(n.endswith(DATA_SUFFIX) for n in names) else {}
    return {
        n: hash_data_file(root / n, ranges[n]) if n in ranges else hash_file(root / n)
        for n in names
    }


def scan_files(root: Path, hashed: dict[str, dict] | None = None) -> dict[str, dict]:
    """Entries for every file below root but the manifest (`hashed`: ones already known)."""
    hashed = dict(hashed or {})
    hashed.update(file_entries(root, [n for n in file_names(root) if n not in hashed]))
    return dict(sorted(hashed.items()))


def _write_json(path: Path, body: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(json.dumps(body, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def write_manifest(ckpt_dir: str | Path, kind: str = "mcore-torch_dist", **info) -> Path:
    """Hash every file of a finished checkpoint directory into its manifest.json (atomic).
    For training checkpoints: call once every rank's files are written; reads them all."""
    return write_files_manifest(ckpt_dir, scan_files(Path(ckpt_dir)), kind, **info)


def write_files_manifest(
    ckpt_dir: str | Path, files: dict[str, dict], kind: str = "mcore-torch_dist", **info
) -> Path:
    """manifest.json of ckpt_dir from file entries hashed elsewhere (atomic; e.g. each rank
    hashed the files it wrote). Refuses entries that do not name exactly the files there."""
    root = Path(ckpt_dir)
    present = file_names(root)
    if sorted(files) != present:
        missing = sorted(set(present) - set(files)) or sorted(set(files) - set(present))
        raise ManifestError(f"{root}: manifest entries and files differ ({missing[0]} ...)")
    path = root / NAME
    body = {"version": VERSION, "format": kind, **info, "files": dict(sorted(files.items()))}
    _write_json(path, body)
    return path


def load_files_manifest(ckpt_dir: str | Path) -> dict[str, dict]:
    """The `files` of ckpt_dir's manifest.json; ManifestError when there is none to check against."""
    root = Path(ckpt_dir)
    path = root / NAME
    if not path.is_file():
        raise ManifestError(
            f"no {NAME} in {root}: nothing to check its bytes against; pass --no-manifest-check "
            f"to trust it as is, or run `python -m converters manifest {root}` on a good copy"
        )
    try:
        files = json.loads(path.read_text()).get("files")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise ManifestError(
            f"{path} is not a valid manifest ({type(err).__name__}): restore it, or pass "
            "--no-manifest-check to trust the checkpoint as is"
        ) from None
    if not isinstance(files, dict):
        raise ManifestError(
            f"{path} has no file hashes (written by an older converter): re-create it with "
            f"`python -m converters manifest {root}` on a good copy, or pass --no-manifest-check"
        )
    return files


def manifest_problems(ckpt_dir: str | Path) -> list[str]:
    """One line per file missing, added, resized or with a byte range whose sha256 differs."""
    root = Path(ckpt_dir)
    want = load_files_manifest(root)
    present = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} - {NAME}
    problems = [f"{root / n}: in {NAME}, missing" for n in sorted(set(want) - present)]
    problems += [f"{root / n}: not in {NAME}" for n in sorted(present - set(want))]
    for name in sorted(set(want) & present):
        problems += _file_problems(root / name, want[name])
    return problems


def _file_problems(path: Path, entry: dict) -> list[str]:
    size = path.stat().st_size
    if size != entry.get("size"):
        return [f"{path}: {size} bytes, {NAME} says {entry.get('size')}"]
    with open(path, "rb") as f:
        if "chunks" in entry:
            return [
                f"{path}: bytes {o}-{o + n} differ from {NAME}"
                for o, n, h in entry["chunks"]
                if _sha256_range(f, o, n) != h
            ]
        return (
            []
            if _sha256_range(f, 0, size) == entry.get("sha256")
            else [f"{path}: sha256 differs from {NAME}"]
        )


def verify_manifest(ckpt_dir: str | Path) -> None:
    """Raise ManifestError (one line: the first problem and how many there are) unless every
    file of ckpt_dir matches its manifest.json byte for byte. Reads every file once."""
    problems = manifest_problems(ckpt_dir)
    if problems:
        more = f" ({len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise ManifestError(
            f"{problems[0]}{more}: the checkpoint was damaged or changed after it was "
            "written; restore it from a good copy"
        )


class ChunkHashes:
    """Checks byte ranges of a checkpoint's files against its manifest as a reader reads them."""

    def __init__(self, root: Path, files: dict[str, dict]):
        self.root = root
        self.files = files
        self.chunks = {
            (name, o): (n, h) for name, e in files.items() for o, n, h in e.get("chunks", [])
        }
        self.checked: set[tuple[str, int]] = set()

    def check_file(self, name: str, data: bytes) -> None:
        """A small file read whole (`.metadata`, `metadata.json`)."""
        want = self.files.get(name)
        if want is None:
            raise ManifestError(
                f"{self.root / name} is not in {self.root / NAME}: the manifest is not this "
                "checkpoint's; restore it, or pass --no-manifest-check"
            )
        if want.get("sha256") != hashlib.sha256(data).hexdigest():
            raise ManifestError(
                f"{self.root / name} differs from {NAME}: the checkpoint was damaged or "
                "changed after it was written; restore it from a good copy"
            )

    def check_chunk(self, name: str, offset: int, length: int, parts) -> None:
        """The item at [offset, offset + length) of data file `name`, from its bytes in order."""
        want = self.chunks.get((name, offset))
        digest = hashlib.sha256()
        for part in parts:
            digest.update(part)
        if want is None or want != (length, digest.hexdigest()):
            why = "are not in" if want is None else "differ from"
            raise ManifestError(
                f"{self.root / name} bytes {offset}-{offset + length} {why} {NAME}: the "
                "checkpoint was damaged or changed after it was written; restore it from a good copy"
            )
        self.checked.add((name, offset))

    def check_unread(self) -> None:
        """The byte ranges no reader asked for (megatron's `_extra_state` items, gaps): so no
        changed byte passes unnoticed, at the cost of reading only those (a few KB)."""
        for (name, offset), (length, _) in sorted(self.chunks.items()):
            if (name, offset) not in self.checked:
                with open(self.root / name, "rb") as f:
                    f.seek(offset)
                    self.check_chunk(name, offset, length, [f.read(length)])
