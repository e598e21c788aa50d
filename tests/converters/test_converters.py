"""python -m converters at world size 1: bit-exact round trips, transformers and verl load the
outputs, manifests, verify, atomic outputs and one-line errors for bad input."""

import json
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from converters import atomic
from converters.cli import main
from converters.convert import convert_hf_to_mcore, convert_mcore_to_hf
from converters.hf_io import INDEX, read_state_dict
from converters.hf_source import HFSource
from converters.hf_writer import ShardedWriter
from converters.manifest import ManifestError, write_manifest
from converters.verify import compare

pytestmark = pytest.mark.mcore_compat


def _exact(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def mcore_dir(tiny_hf_dir, tmp_path_factory):
    return convert_hf_to_mcore(tiny_hf_dir, tmp_path_factory.mktemp("conv") / "mcore")


@pytest.fixture(scope="module")
def sharded_hf_dir(mcore_dir, tiny_hf_dir, tmp_path_factory):
    """The tiny model back in HF form, split into several shards with an index."""
    out = tmp_path_factory.mktemp("conv") / "hf"
    return convert_mcore_to_hf(mcore_dir, out, template=tiny_hf_dir, max_shard_bytes=100_000)


def test_hf_mcore_hf_is_bit_exact_in_hub_layout(tiny_hf_dir, sharded_hf_dir):
    _exact(read_state_dict(sharded_hf_dir), read_state_dict(tiny_hf_dir))
    index = json.loads((sharded_hf_dir / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in index["weight_map"]
    for name in ("config.json", "generation_config.json", "manifest.json"):
        assert (sharded_hf_dir / name).is_file(), name


def test_transformers_loads_the_export_with_the_same_logits(sharded_hf_dir, tiny_hf_model):
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(
        sharded_hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, tiny_hf_model(ids).logits)


def test_dist_checkpoint_loads_into_the_mcore_model(world1, tiny_hf_dir, mcore_dir):
    from megatron.core import dist_checkpointing

    from backend.model.build import build_model
    from backend.qwen3_moe import load_qwen3_moe_spec
    from converters.sharding import load_hf_into_model

    spec = load_qwen3_moe_spec(tiny_hf_dir)
    ref, model = build_model(spec, world1), build_model(spec, world1)
    load_hf_into_model(ref, read_state_dict(tiny_hf_dir), spec)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(mcore_dir)))
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_bf16_round_trip_and_multi_shard_source(tmp_path, sharded_hf_dir, mcore_dir):
    mcore = convert_hf_to_mcore(sharded_hf_dir, tmp_path / "m", dtype="bf16")
    back = convert_mcore_to_hf(mcore, tmp_path / "h", template=sharded_hf_dir)
    expected = {k: v.to(torch.bfloat16) for k, v in read_state_dict(sharded_hf_dir).items()}
    _exact(read_state_dict(back), expected)
    cast = convert_mcore_to_hf(
        mcore_dir, tmp_path / "cast", template=sharded_hf_dir, dtype="bf16"
    )  # fp32 chunks
    _exact(read_state_dict(cast), expected)
    assert main(["verify", str(sharded_hf_dir), str(back)]) == 1  # fp32 vs bf16, bit-exact
    assert main(["verify", str(sharded_hf_dir), str(back), "--atol", "1e-2"]) == 0


def test_verify_hf_vs_dist_and_manifests(tiny_hf_dir, mcore_dir, sharded_hf_dir, capsys):
    assert main(["verify", str(tiny_hf_dir), str(mcore_dir)]) == 0
    assert main(["verify", str(mcore_dir), str(sharded_hf_dir)]) == 0
    assert main(["verify", str(mcore_dir)]) == 0
    assert main(["verify", str(sharded_hf_dir)]) == 0
    manifest = json.loads((mcore_dir / "manifest.json").read_text())
    entry = manifest["tensors"]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert (
        entry["shape"] == [256, 64] and entry["dtype"] == "float32" and len(entry["sha256"]) == 64
    )
    assert "verify: 69 tensors compared, 0 mismatches" in capsys.readouterr().out


def test_verify_reports_each_mismatch_on_one_line(tmp_path, sharded_hf_dir, capsys):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "copy"
    shutil.copytree(sharded_hf_dir, copy)
    first = sorted(copy.glob("model-*.safetensors"))[0]
    tensors = load_file(first)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1
    save_file(tensors, first, metadata={"format": "pt"})
    lines = []
    assert compare(sharded_hf_dir, copy, report=lines.append) == (69, 1)
    assert lines == [f"{name}: not bit-exact, max abs diff 1"]
    assert main(["verify", str(copy)]) == 1
    assert f"{name}: sha256" in capsys.readouterr().out


def test_verl_loads_the_checkpoint_and_its_layout_exports(world1, tiny_hf_dir, mcore_dir, tmp_path):
    """verl's initial-weights loader reads the output; verl's own save layout converts back."""
    pytest.importorskip("verl")
    from megatron.core import dist_checkpointing

    from backend.model.build import build_model
    from backend.qwen3_moe import load_qwen3_moe_spec

    try:
        from verl.utils.model import load_mcore_dist_weights
    except ImportError as err:  # verl 0.9 needs a newer megatron-core than 0.12
        pytest.skip(f"verl does not import here: {err}")
    model = build_model(load_qwen3_moe_spec(tiny_hf_dir), world1)
    load_mcore_dist_weights([model], str(mcore_dir))
    step = tmp_path / "ckpts" / "global_step_3" / "actor" / "model" / "dist_ckpt"
    step.mkdir(parents=True)
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(step))  # as verl nests it
    (tmp_path / "ckpts" / "latest_checkpointed_iteration.txt").write_text("3")
    with pytest.raises(ManifestError, match="no manifest.json in .*--no-manifest-check"):
        convert_mcore_to_hf(tmp_path / "ckpts", tmp_path / "hf", template=tiny_hf_dir)
    write_manifest(step)  # as our engine does after a save
    out = convert_mcore_to_hf(tmp_path / "ckpts", tmp_path / "hf", template=tiny_hf_dir)
    _exact(read_state_dict(out), read_state_dict(tiny_hf_dir))


# ---- atomic outputs ----------------------------------------------------------------


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_interrupted_runs_leave_no_output(tiny_hf_dir, mcore_dir, tmp_path, monkeypatch):
    calls = {"n": 0}
    real_read = HFSource.read_into

    def failing_read(self, name, out):
        calls["n"] += 1
        if calls["n"] == 20:
            raise RuntimeError("disk unplugged")
        return real_read(self, name, out)

    monkeypatch.setattr(HFSource, "read_into", failing_read)
    with pytest.raises(RuntimeError, match="disk unplugged"):
        convert_hf_to_mcore(tiny_hf_dir, tmp_path / "m")
    monkeypatch.setattr(
        ShardedWriter, "close", lambda self: (_ for _ in ()).throw(RuntimeError("killed"))
    )
    with pytest.raises(RuntimeError, match="killed"):
        convert_mcore_to_hf(mcore_dir, tmp_path / "h", template=tiny_hf_dir)
    assert list(tmp_path.iterdir()) == []


def test_force_replaces_only_on_success(tiny_hf_dir, mcore_dir, tmp_path, monkeypatch):
    out = tmp_path / "h"
    out.mkdir()
    (out / "old.txt").write_text("previous export")
    monkeypatch.setattr(
        ShardedWriter, "close", lambda self: (_ for _ in ()).throw(RuntimeError("killed"))
    )
    with pytest.raises(RuntimeError):
        convert_mcore_to_hf(mcore_dir, out, template=tiny_hf_dir, force=True)
    assert (out / "old.txt").is_file() and not _leftovers(tmp_path)
    monkeypatch.undo()
    convert_mcore_to_hf(mcore_dir, out, template=tiny_hf_dir, force=True)
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    assert not _leftovers(tmp_path)


# ---- bad input: one line, exit 2 ---------------------------------------------------------


def _one_line_error(capsys, argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for needle in needles:
        assert needle in err, err
    return err


def _broken_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("manifest.json"))
    return dst


def test_missing_and_truncated_shards(sharded_hf_dir, tmp_path, capsys):
    second, third = sorted(
        set(json.loads((sharded_hf_dir / INDEX).read_text())["weight_map"].values())
    )[1:3]
    broken = _broken_copy(sharded_hf_dir, tmp_path / "missing")
    (broken / second).unlink()
    _one_line_error(
        capsys,
        ["hf-to-mcore", str(broken), str(tmp_path / "o")],
        f"names missing shard(s) {second}",
        "re-download",
    )
    cut = _broken_copy(sharded_hf_dir, tmp_path / "cut")
    shard = cut / third
    shard.write_bytes(shard.read_bytes()[:-100])
    _one_line_error(
        capsys,
        ["hf-to-mcore", str(cut), str(tmp_path / "o")],
        f"{third} is unreadable or truncated",
        "re-download",
    )
    assert not (tmp_path / "o").exists()


def test_weights_that_do_not_fit_the_config(tiny_hf_dir, tmp_path, capsys):
    from safetensors.torch import save_file

    other = _broken_copy(tiny_hf_dir, tmp_path / "cut_k")
    weights = read_state_dict(other)
    name = "model.layers.1.self_attn.k_proj.weight"
    weights[name] = weights[name][:-1].clone()
    for shard in other.glob("*.safetensors"):
        shard.unlink()
    (other / INDEX).unlink(missing_ok=True)
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    _one_line_error(
        capsys,
        ["hf-to-mcore", str(other), str(tmp_path / "o")],
        f"{name} has shape",
        "decoder.layers.1.self_attention.linear_qkv.weight",
        "config.json and the weights disagree",
    )


def test_wrong_model_type_and_target_config(tiny_hf_dir, tmp_path, capsys):
    other = _broken_copy(tiny_hf_dir, tmp_path / "llama")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    _one_line_error(
        capsys, ["hf-to-mcore", str(other), str(tmp_path / "o")], "model_type is 'llama'"
    )
    for key, field, value in (
        ("num_local_experts", "num_experts", 16),
        ("hidden_size", "hidden_size", 128),
    ):
        target = tmp_path / f"{field}.json"
        target.write_text(json.dumps({**config, key: value}))
        _one_line_error(
            capsys,
            ["hf-to-mcore", str(tiny_hf_dir), str(tmp_path / "o"), "--target-config", str(target)],
            f"{field}: checkpoint has {config[key]}, --target-config",
            f"has {value}; ",
        )


def test_plan_the_model_cannot_take(tiny_hf_dir, tmp_path, capsys):
    _one_line_error(
        capsys,
        ["hf-to-mcore", str(tiny_hf_dir), str(tmp_path / "o"), "--tp", "3"],
        "tp=3 does not divide num_key_value_heads=2",
        "legal tp",
    )
    _one_line_error(
        capsys,
        ["hf-to-mcore", str(tiny_hf_dir), str(tmp_path / "o"), "--ep", "3"],
        "ep=3 does not divide num_experts=8",
    )


def test_output_exists_and_disk_full(tiny_hf_dir, mcore_dir, tmp_path, capsys, monkeypatch):
    _one_line_error(capsys, ["hf-to-mcore", str(tiny_hf_dir), str(mcore_dir)], "exists", "--force")
    _one_line_error(
        capsys,
        ["mcore-to-hf", str(mcore_dir), str(tiny_hf_dir), "--template", str(tiny_hf_dir)],
        "exists",
        "--force",
    )
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    _one_line_error(
        capsys, ["hf-to-mcore", str(tiny_hf_dir), str(tmp_path / "o")], "not enough disk space"
    )
    _one_line_error(
        capsys,
        ["mcore-to-hf", str(mcore_dir), str(tmp_path / "o"), "--template", str(tiny_hf_dir)],
        "not enough disk space",
    )
    assert list(tmp_path.iterdir()) == []


def test_template_that_does_not_match_the_checkpoint(tiny_hf_dir, mcore_dir, tmp_path, capsys):
    other = _broken_copy(tiny_hf_dir, tmp_path / "t")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_local_experts": 16}))
    _one_line_error(
        capsys,
        ["mcore-to-hf", str(mcore_dir), str(tmp_path / "o"), "--template", str(other)],
        "router.weight: checkpoint has global shape (2, 8, 64)",
        "implies (2, 16, 64)",
        "pass the config the checkpoint was trained with",
    )


def test_cli_process_prints_one_line_without_traceback(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "converters",
            "hf-to-mcore",
            str(tmp_path / "nope"),
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"error: no config.json at {tmp_path / 'nope'}: "
        "pass an HF checkpoint directory or its config.json"
    ]
