"""HF config -> Qwen3MoeSpec: both spellings accepted, bad configs rejected with clear messages."""

import json
import re

import pytest

from backend.qwen3_moe import ConfigError, load_qwen3_moe_spec
from parallel.models import TINY_QWEN3_MOE
from recipes.local.task.hf_checkpoints import tiny_config

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)


def test_config_object_dict_and_file_agree(tmp_path):
    cfg = tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    from_obj = load_qwen3_moe_spec(cfg)
    assert load_qwen3_moe_spec(tmp_path) == from_obj
    assert load_qwen3_moe_spec(tmp_path / "config.json") == from_obj
    assert from_obj.head_dim == 32 != from_obj.hidden_size // from_obj.num_heads
    assert (from_obj.num_experts, from_obj.top_k, from_obj.rope_theta) == (8, 2, 10000.0)


def test_hub_spellings_num_experts_and_rope_theta():
    # hub config.json (transformers 4 era) vs transformers 5 spellings
    hub = {**TINY_QWEN3_MOE, "model_type": "qwen3_moe", "num_experts": 8, "rope_theta": 5e5}
    tf5 = {k: v for k, v in hub.items() if k not in ("num_experts", "rope_theta")}
    tf5 |= {"num_local_experts": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert load_qwen3_moe_spec(hub) == load_qwen3_moe_spec(tf5)
    assert load_qwen3_moe_spec(hub).rope_theta == 5e5


def _tiny_dict(**changes):
    return {**tiny_config().to_dict(), **changes}


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_experts_per_tok=9), "num_experts_per_tok=9 exceeds num_experts=8"),
        (
            dict(num_attention_heads=6, num_key_value_heads=4),
            "num_attention_heads=6 is not divisible by num_key_value_heads=4",
        ),
        (dict(model_type="llama"), "model_type is 'llama', expected 'qwen3_moe'"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings=true is not supported"),
        (dict(mlp_only_layers=[0]), "dense layers"),
        (dict(num_hidden_layers=None), "config has no num_hidden_layers"),
        (
            dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
            "rope type 'yarn' is not supported",
        ),
    ],
)
def test_bad_config_names_the_problem(changes, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_qwen3_moe_spec(_tiny_dict(**changes))


def test_missing_and_corrupt_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json at"):
        load_qwen3_moe_spec(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_qwen3_moe_spec(tmp_path)
