"""The converters' output files: O_DIRECT stages and the buffered fallback write exactly the bytes given."""

import errno
import os

import numpy as np
import pytest
import torch

from converters import output
from converters.output import BufferedOutput, DirectOutput, open_output

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)


def _direct(path):
    try:
        return DirectOutput(path)
    except OSError as err:
        pytest.skip(f"no O_DIRECT on {path.parent}: {err}")


@pytest.fixture
def small_stages(monkeypatch):
    """Stages of 64 KiB, so a few writes cross several of them and wrap around all three."""
    monkeypatch.setattr(output, "STAGE", 64 << 10)
    monkeypatch.setattr(output, "GIL_FREE_COPY", 4 << 10)


def _pieces() -> list:
    rng = np.random.default_rng(0)
    big = rng.integers(0, 256, 300_000, dtype=np.uint8)
    return [
        b"header",
        big.tobytes(),
        memoryview(big)[7:70_001],
        b"x" * 4095,
        torch.arange(50_000, dtype=torch.bfloat16).view(torch.uint8).numpy(),
        b"",
    ]


@pytest.mark.parametrize("kind", ["direct", "buffered"])
def test_writes_with_a_sync_midway_give_the_exact_bytes(kind, tmp_path, small_stages):
    path = tmp_path / "out.bin"
    f = _direct(path) if kind == "direct" else BufferedOutput(path)
    want = b""
    with f:
        for i, piece in enumerate(_pieces()):
            assert f.write(piece) == len(memoryview(piece).cast("B"))
            want += bytes(memoryview(piece).cast("B"))
            assert f.tell() == len(want)
            if i == 2:  # a synced, padded tail is rewritten by the writes that follow
                f.sync()
                assert path.read_bytes() == want
        f.sync()
    assert path.read_bytes() == want


def test_torch_save_into_direct_output_loads_back(tmp_path, small_stages):
    path = tmp_path / "t.pt"
    tensors = {"a": torch.randn(300, 70), "b": torch.arange(10)}
    with _direct(path) as f:
        torch.save(tensors, f)
        f.sync()
    loaded = torch.load(path, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_falls_back_where_o_direct_is_refused(tmp_path, monkeypatch):
    def refuse(self, path):
        raise OSError(errno.EINVAL, "Invalid argument", str(path))

    monkeypatch.setattr(DirectOutput, "__init__", refuse)
    with open_output(tmp_path / "out.bin") as f:
        assert isinstance(f, BufferedOutput)
        f.write(b"abc")
        f.sync()
    assert (tmp_path / "out.bin").read_bytes() == b"abc"


def test_a_failed_disk_write_surfaces_at_sync(tmp_path, small_stages, monkeypatch):
    f = _direct(tmp_path / "out.bin")

    def disk_full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(output.os, "pwrite", disk_full)
    with f, pytest.raises(OSError, match="No space left"):
        f.write(b"y" * (200 << 10))
        f.sync()
