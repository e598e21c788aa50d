"""Dist checkpoint chunks are read straight into place only when their bytes are in this
machine's order; a chunk saved on a machine of the other order goes through torch.load."""

import io
import sys
import zipfile

import numpy as np
import pytest
import torch

from converters import dist_read
from converters.dist_read import _Slice, native_byte_order, read_slice

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)


def _saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _other_byte_order(raw: bytes, itemsize: int) -> bytes:
    """The same torch.save file as a machine of the other byte order writes it."""
    other = "big" if sys.byteorder == "little" else "little"
    out = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(raw)) as src,
        zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst,
    ):
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.rsplit("/", 1)[-1] == "byteorder":
                data = other.encode()
            elif "/data/" in info.filename:
                data = np.frombuffer(data, dtype=f"u{itemsize}").byteswap().tobytes()
            dst.writestr(info.filename, data)
    return out.getvalue()


def test_a_chunk_of_the_other_byte_order_is_swapped_not_copied(tmp_path, monkeypatch):
    t = (torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7).to(torch.bfloat16)
    plain = _saved(t)
    swapped = _other_byte_order(plain, t.element_size())
    path = tmp_path / "chunks.distcp"
    path.write_bytes(plain + swapped)
    straight = []  # chunks read straight into place (the other order's would be garbage,
    real = dist_read._load_into  # or a crash: torch's meta load of it byteswaps a meta storage)
    monkeypatch.setattr(
        dist_read, "_load_into", lambda chunk, out: straight.append(chunk) or real(chunk, out)
    )
    with open(path, "rb", buffering=0) as f:
        mine, other = _Slice(f, 0, len(plain)), _Slice(f, len(plain), len(swapped))
        assert native_byte_order(mine) and not native_byte_order(other)
        for chunk in (mine, other):
            out = torch.empty_like(t)
            assert torch.equal(read_slice(chunk, out, native_byte_order(chunk)), t)
    assert straight == [mine]


def test_a_chunk_without_a_byteorder_record_is_little_endian(tmp_path):
    buf = io.BytesIO()
    torch.save(torch.ones(3), buf, _disable_byteorder_record=True)
    path = tmp_path / "old.distcp"
    path.write_bytes(buf.getvalue())
    with open(path, "rb", buffering=0) as f:
        assert native_byte_order(_Slice(f, 0, len(buf.getvalue()))) == (sys.byteorder == "little")
