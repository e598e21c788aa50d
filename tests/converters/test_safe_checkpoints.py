"""Checkpoints are data, never code: crafted pickles are refused without running anything,
real megatron-core saves pass; per-rank state round-trips as tensors + JSON; manifests catch
every changed byte; one writer per output and dead runs' temp dirs are removed."""

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from backend.platform.compat import mcore_version
from converters import atomic
from converters.cli import main as converters_main
from converters.errors import ConversionError
from converters.manifest import ManifestError, manifest_problems, verify_manifest, write_manifest
from converters.pickles.safe_pickle import (
    UnsafeCheckpointError,
    check_dist_checkpoint,
    check_metadata,
)

pytestmark = pytest.mark.mcore_compat


def _global(module: str, name: str) -> bytes:
    """Protocol-4 STACK_GLOBAL of module.name (the name may be dotted, as pickle allows)."""

    def text(s: str) -> bytes:
        raw = s.encode()
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE

    return text(module) + text(name) + b"\x93"


def _call(module: str, name: str, *args: str) -> bytes:
    """A protocol-4 pickle that calls module.name(*args) (REDUCE) when loaded."""
    body = _global(module, name) + b"".join(b"\x8c" + bytes([len(a)]) + a.encode() for a in args)
    tuple_op = {1: b"\x85", 2: b"\x86", 3: b"\x87"}[len(args)]
    return b"\x80\x04" + body + tuple_op + b"R."


class _System:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _payloads(victim: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (pickle bytes, the (module.name) the refusal must name)."""
    return {
        "dotted name": (
            _call("torch.distributed.checkpoint.filesystem", "os.mkdir", str(victim)),
            "torch.distributed.checkpoint.filesystem.os.mkdir",
        ),
        "os.system via REDUCE": (
            pickle.dumps(_System(f"mkdir {victim}"), protocol=2),
            "posix.system",
        ),
        "class outside the list": (_call("subprocess", "Popen", "mkdir"), "subprocess.Popen"),
        "allowed module, other name": (
            _call("torch.distributed.checkpoint.metadata", "os.mkdir", str(victim)),
            "torch.distributed.checkpoint.metadata.os.mkdir",
        ),
    }


PAYLOADS = [
    "dotted name",
    "os.system via REDUCE",
    "class outside the list",
    "allowed module, other name",
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_crafted_metadata_is_refused_in_one_line_without_side_effect(payload, tmp_path):
    victim = tmp_path / "created_by_the_payload"
    data, named = _payloads(victim)[payload]
    meta = tmp_path / ".metadata"
    meta.write_bytes(data)
    with pytest.raises(UnsafeCheckpointError) as err:
        check_metadata(meta)
    message = str(err.value)
    assert message.startswith(
        f"{meta} references {named}, which a torch_dist checkpoint never holds"
    )
    assert "\n" not in message and "nothing in it was run" in message
    assert not victim.exists()


@pytest.fixture(scope="module")
def megatron_save(tmp_path_factory, tiny_hf_dir, world1):
    """A torch_dist checkpoint saved by megatron-core itself (this release): the model plus an
    optimizer-like sharded object and tensor, as a training save holds them."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from backend.model.build import build_model
    from backend.qwen3_moe import load_qwen3_moe_spec

    model = build_model(load_qwen3_moe_spec(tiny_hf_dir), world1)
    state = model.sharded_state_dict()
    state["param_groups"] = ShardedObject(
        "optimizer.param_groups",
        {"lr": 1e-3, "betas": (0.9, 0.95), "step": 3},
        (1,),
        (0,),
        replica_id=0,
    )
    state["exp_avg"] = ShardedTensor.from_rank_offsets(
        "optimizer.exp_avg", torch.ones(4, 3), replica_id=0
    )
    out = tmp_path_factory.mktemp("megatron") / "dist_ckpt"
    out.mkdir()
    dist_checkpointing.save(state, str(out))
    shutil.copy(tiny_hf_dir / "config.json", out / "hf_config.json")
    return out


def test_a_real_megatron_save_passes_and_its_manifest_round_trips(megatron_save, tmp_path):
    check_dist_checkpoint(megatron_save)  # .metadata, common.pt, byte items: all plain data
    ckpt = shutil.copytree(megatron_save, tmp_path / "ckpt")
    # megatron-core <= 0.16 writes common.pt; 0.19 keeps that state as the byte item
    # "common_state" of the .distcp files (vetted with the other byte items above)
    common = ckpt / "common.pt"
    assert common.is_file() == (mcore_version() < Version("0.19"))
    write_manifest(ckpt)
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert set(files) == {p.name for p in ckpt.iterdir()} - {"manifest.json"}  # common.pt included
    verify_manifest(ckpt)
    data = sorted(ckpt.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    if not common.is_file():
        common.write_bytes(b"\0")  # a file the manifest does not name
    else:
        common.write_bytes(common.read_bytes() + b"\0")
    problems = sorted(manifest_problems(ckpt), key=lambda line: "common.pt" in line)
    assert (
        len(problems) == 2
        and problems[0].startswith(f"{data}: bytes ")
        and problems[0].endswith(" differ from manifest.json")
    )
    grown = f"{common}: 1256 bytes, manifest.json says 1255"
    assert problems[1] == (grown if "common.pt" in files else f"{common}: not in manifest.json")
    with pytest.raises(ManifestError, match=r"\(1 more problems\): the checkpoint was damaged"):
        verify_manifest(ckpt)


def test_a_crafted_byte_item_or_common_pt_is_refused(megatron_save, tmp_path):
    victim = tmp_path / "victim"
    ckpt = shutil.copytree(megatron_save, tmp_path / "ckpt")
    torch.save(_System(f"mkdir {victim}"), ckpt / "common.pt")
    with pytest.raises(
        UnsafeCheckpointError, match=f"{ckpt / 'common.pt'} is not plain tensor data"
    ):
        check_dist_checkpoint(ckpt)
    assert not victim.exists()


def test_cli_refuses_a_crafted_checkpoint_in_one_line(megatron_save, tmp_path, tiny_hf_dir, capsys):
    victim = tmp_path / "victim"
    ckpt = shutil.copytree(megatron_save, tmp_path / "ckpt")
    (ckpt / ".metadata").write_bytes(_payloads(victim)["dotted name"][0])
    argv = ["mcore-to-hf", str(ckpt), str(tmp_path / "out"), "--template", str(tiny_hf_dir),
            "--no-manifest-check"]  # fmt: skip
    assert converters_main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "references torch.distributed.checkpoint.filesystem.os.mkdir" in err
    )
    # verify: a finding (exit 1), the refusal its line; no tensor is read through that .metadata
    assert converters_main(["verify", str(ckpt), str(tiny_hf_dir)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{ckpt / '.metadata'} references torch.distributed.checkpoint")
    assert out[-1] == "verify: 0 tensors compared, 1 mismatches"
    assert not victim.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("crafted", [".metadata", "common.pt"])
def test_verify_finds_a_crafted_file_whose_manifest_agrees(
    crafted, megatron_save, tmp_path, capsys
):
    """The manifest is a plain sha256 list: rewritten to match, it vouches for nothing. verify
    runs the allow-lists that resume and mcore-to-hf run, and never says 0 mismatches."""
    from converters.manifest import hash_file

    victim = tmp_path / "victim"
    ckpt = shutil.copytree(megatron_save, tmp_path / "ckpt")
    write_manifest(ckpt)
    if crafted == ".metadata":
        (ckpt / crafted).write_bytes(_payloads(victim)["allowed module, other name"][0])
    else:
        torch.save(_System(f"mkdir {victim}"), ckpt / crafted)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][crafted] = hash_file(ckpt / crafted)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert manifest_problems(ckpt) == []  # the bytes agree with the manifest
    assert converters_main(["verify", str(ckpt)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[1].startswith("verify: ") and out[1].endswith(", 1 mismatches")
    assert out[0].startswith(str(ckpt / crafted)) and "nothing in it was run" in out[0]
    assert "weights_only" not in out[0] and not victim.exists()


# ---- outputs: one writer, dead runs' temp dirs ---------------------------------------------


def test_a_second_writer_is_refused_while_the_first_holds_the_output(tmp_path):
    target = tmp_path / "out"
    with atomic.atomic_dir(target) as tmp:
        (tmp / "a").write_text("first")
        with pytest.raises(
            ConversionError,
            match=f"{target} is being written by another process \\(pid {os.getpid()}",
        ):
            with atomic.atomic_dir(target, force=True):
                pass
    assert (target / "a").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no lock file, no temp dir


def test_temp_dirs_of_dead_runs_are_removed_live_ones_kept(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(dead.stdout)
    stale = tmp_path / f".out.tmp-{dead_pid}-0badc0de"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "big.distcp").write_bytes(b"x" * 1000)
    live = tmp_path / f".out.tmp-{os.getppid()}-feedf00d"  # our parent: alive
    live.mkdir()
    other = tmp_path / f".other.tmp-{dead_pid}-0badc0de"  # another output's: not ours to judge
    other.mkdir()
    with atomic.atomic_dir(tmp_path / "out") as tmp:
        (tmp / "f").write_text("x")
    assert not stale.exists() and live.is_dir() and other.is_dir()
