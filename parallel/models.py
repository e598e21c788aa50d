"""Model configs the planner knows without the hub, and loading a spec from --model."""

from backend.qwen3_moe import Qwen3MoeSpec, load_qwen3_moe_spec

# Qwen/Qwen3-30B-A3B config.json as released (30.5B parameters, 3.3B active per token).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "attention_bias": False,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "max_position_embeddings": 40960,
    "router_aux_loss_coef": 0.001,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}

DEFAULT_MODEL_NAME = "Qwen3-30B-A3B"


def load_spec(model: str | None = None) -> Qwen3MoeSpec:
    """Spec from an HF config.json path or checkpoint dir; the embedded Qwen3-30B-A3B if None."""
    return load_qwen3_moe_spec(QWEN3_30B_A3B if model is None else model)
