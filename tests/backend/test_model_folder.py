"""The model folder (backend/qwen3_moe/) and the registry the generic code finds it through.

A second config of the family, shaped like Qwen3-235B-A22B (more layers, experts, heads per
query group and a larger top-k than the tiny Qwen3-30B-A3B-like model), goes through the
generic code unchanged: it builds, converts HF -> mcore -> HF bit-exactly and matches
transformers' forward."""

import re
from pathlib import Path

import pytest
import torch

from backend.model.build import BuildOptions, build_model
from backend.model.families import ConfigError, family, family_of, load_spec, model_types
from backend.model.weight_mappings import GatedMLPMapping, QKVMapping
from backend.qwen3_moe import FAMILY, Qwen3MoeSpec
from converters.hf_io import read_state_dict
from converters.sharding import load_hf_into_model, model_to_hf
from parallel.params import hf_param_counts, param_counts

pytestmark = pytest.mark.mcore_compat
ROOT = Path(__file__).resolve().parents[2]

# Qwen3-235B-A22B's proportions (64 heads over 4 KV heads, 128 experts, top-8), shrunk
QWEN3_235B_A22B_LIKE = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=16,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def big_hf_dir(tmp_path_factory) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(5)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN3_235B_A22B_LIKE))
    out = tmp_path_factory.mktemp("qwen3_235b_like")
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def big_hf_model(big_hf_dir):
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(
        big_hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _exact(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


# ---- the registry -------------------------------------------------------------------


def test_the_family_is_found_by_model_type_and_from_its_spec(big_hf_dir):
    assert "qwen3_moe" in model_types()
    assert family("qwen3_moe") is FAMILY
    spec = load_spec(big_hf_dir)
    assert isinstance(spec, Qwen3MoeSpec) and family_of(spec) is FAMILY
    assert (spec.num_layers, spec.num_experts, spec.top_k, spec.heads_per_group) == (3, 16, 4, 4)
    assert "Qwen3MoeForCausalLM" in FAMILY.architectures


def test_an_unknown_model_type_names_the_known_ones():
    with pytest.raises(ConfigError, match="model_type is 'llama', expected 'qwen3_moe'"):
        load_spec({"model_type": "llama"})


def test_mappings_own_their_sharding_rules():
    kinds = {type(m) for m in FAMILY.mappings}
    assert {QKVMapping, GatedMLPMapping} <= kinds
    fc1 = next(m for m in FAMILY.mappings if isinstance(m, GatedMLPMapping))
    assert fc1.is_expert and fc1.tp_group == "etp"
    full = torch.arange(8.0)[:, None]  # gate rows 0-3, up rows 4-7
    parts = [fc1.shard(full, 0, rank, 2) for rank in range(2)]
    assert parts[0].flatten().tolist() == [0, 1, 4, 5]
    assert torch.equal(fc1.unshard(parts, 0), full)
    qkv = next(m for m in FAMILY.mappings if isinstance(m, QKVMapping))
    assert not qkv.is_expert and qkv.tp_group == "tp"
    assert torch.equal(qkv.unshard([qkv.shard(full, 0, r, 4) for r in range(4)], 0), full)


def test_generic_code_does_not_recognise_experts_by_name():
    """Experts are the mappings' `is_expert` and the parameters' tags, not name substrings."""
    generic = [
        *sorted((ROOT / "backend").glob("*.py")),
        *sorted((ROOT / "converters").glob("*.py")),
        *sorted((ROOT / "parallel").glob("*.py")),
    ]
    offenders = [
        str(p.relative_to(ROOT)) for p in generic if re.search(r"mlp\.experts", p.read_text())
    ]
    assert offenders == []


# ---- a second config through the generic code -----------------------------------------


def test_parameter_counts_match_transformers(big_hf_dir, big_hf_model):
    counts = param_counts(load_spec(big_hf_dir))
    assert hf_param_counts(big_hf_model) == (counts.total, counts.active)


def test_hf_mcore_hf_conversion_is_bit_exact(big_hf_dir, tmp_path):
    from converters.convert import convert_hf_to_mcore, convert_mcore_to_hf

    mcore = convert_hf_to_mcore(big_hf_dir, tmp_path / "mcore")
    back = convert_mcore_to_hf(mcore, tmp_path / "hf", template=big_hf_dir)
    _exact(read_state_dict(back), read_state_dict(big_hf_dir))


@pytest.mark.parametrize(
    "opts",
    [
        BuildOptions(experts="sequential", attention="local"),
        BuildOptions(experts="grouped", attention="sdpa", grouped_gemm="loop"),
    ],
    ids=["mcore-local", "grouped-sdpa"],
)
def test_the_built_model_matches_transformers(world1, big_hf_dir, big_hf_model, opts):
    spec = load_spec(big_hf_dir)
    model = build_model(spec, world1, opts).eval()
    hf = read_state_dict(big_hf_dir)
    load_hf_into_model(model, hf, spec)
    _exact(model_to_hf(model, spec), hf)
    from backend.model.forward import forward_logits

    ids = torch.randint(0, spec.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, ref = forward_logits(model, ids), big_hf_model(ids).logits
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-5
