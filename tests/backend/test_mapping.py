"""HF <-> mcore name table at world size 1: bit-exact round trips, special cases, errors."""

import pytest
import torch

from backend.model.weight_mappings import fuse_qkv, split_qkv
from backend.qwen3_moe import fuse_experts, load_qwen3_moe_spec, unfuse_experts
from backend.shared.errors import CheckpointError
from converters.hf_io import read_state_dict
from converters.table import ExpertSlice, MappingError, hf_to_mcore, mcore_to_hf


def _assert_bit_exact(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def spec(tiny_hf_dir):
    return load_qwen3_moe_spec(tiny_hf_dir)


def test_disk_layout_round_trip_is_bit_exact(tiny_hf_dir, spec):
    on_disk = read_state_dict(tiny_hf_dir)  # per-expert keys, as on the hub
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in on_disk
    _assert_bit_exact(mcore_to_hf(hf_to_mcore(on_disk, spec), spec), on_disk)


def test_in_memory_fused_round_trip_is_bit_exact(tiny_hf_model, spec):
    in_memory = tiny_hf_model.state_dict()  # transformers 5 fused experts
    assert "model.layers.0.mlp.experts.gate_up_proj" in in_memory
    back = mcore_to_hf(hf_to_mcore(in_memory, spec), spec, fused_experts=True)
    _assert_bit_exact(back, dict(in_memory))


def test_fused_and_disk_layouts_hold_the_same_tensors(tiny_hf_dir, tiny_hf_model):
    _assert_bit_exact(unfuse_experts(tiny_hf_model.state_dict()), read_state_dict(tiny_hf_dir))
    _assert_bit_exact(fuse_experts(read_state_dict(tiny_hf_dir)), dict(tiny_hf_model.state_dict()))


def test_qkv_is_fused_per_query_group(spec):
    d, hpg = spec.head_dim, spec.heads_per_group
    # each row holds its own head id so the layout is readable
    q = torch.arange(spec.num_heads).repeat_interleave(d)[:, None].float().expand(-1, 3)
    k = 100 + torch.arange(spec.num_kv_heads).repeat_interleave(d)[:, None].float().expand(-1, 3)
    v = 200 + torch.arange(spec.num_kv_heads).repeat_interleave(d)[:, None].float().expand(-1, 3)
    qkv = fuse_qkv(q, k, v, spec)
    heads = qkv[::d, 0].tolist()  # one entry per head block
    per_group = hpg + 2
    for g in range(spec.num_kv_heads):
        block = heads[g * per_group : (g + 1) * per_group]
        assert block == [*range(g * hpg, (g + 1) * hpg), 100 + g, 200 + g]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(qkv, spec), (q, k, v), strict=True))


def test_fc1_is_gate_then_up_and_experts_follow_the_ep_slice(tiny_hf_dir, spec):
    hf = read_state_dict(tiny_hf_dir)
    sl = ExpertSlice(spec.num_experts, ep_size=2, ep_rank=1)
    mc = hf_to_mcore(hf, spec, sl)
    fc1 = mc["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    gate = hf["model.layers.0.mlp.experts.5.gate_proj.weight"]  # global 4 + local 1
    up = hf["model.layers.0.mlp.experts.5.up_proj.weight"]
    assert torch.equal(fc1, torch.cat((gate, up)))
    assert not any(".local_experts.4." in n for n in mc)


def test_missing_weight_is_named(tiny_hf_dir, spec):
    hf = read_state_dict(tiny_hf_dir)
    del hf["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(
        MappingError,
        match=r"HF checkpoint lacks weights: model\.layers\.1\.self_attn\.k_norm\.weight",
    ):
        hf_to_mcore(hf, spec)


def test_weights_for_another_config_are_rejected(tiny_hf_dir, tiny_config_factory):
    hf = read_state_dict(tiny_hf_dir)
    one_layer = load_qwen3_moe_spec(tiny_config_factory(num_hidden_layers=1))
    with pytest.raises(
        MappingError, match="weights this Qwen3-MoE config does not use: model.layers.1"
    ):
        hf_to_mcore(hf, one_layer)


def test_unreadable_checkpoints(tmp_path, tiny_hf_dir):
    with pytest.raises(CheckpointError, match="is not a directory"):
        read_state_dict(tmp_path / "nope")
    with pytest.raises(
        CheckpointError, match="no model.safetensors or model.safetensors.index.json"
    ):
        read_state_dict(tmp_path)
    data = (tiny_hf_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors is unreadable or truncated"):
        read_state_dict(tmp_path)
