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

# The tiny Qwen3-MoE of the CPU run and the tests (recipes/local/task/hf_checkpoints.py builds and saves
# it): the same architecture (GQA, qk-norm, softmax top-k routing renormalised, untied head),
# shrunk so CPU runs take seconds; head_dim differs from hidden/heads on purpose, as it does
# in the real model (128 vs 2048/32 = 64). Keyword arguments of transformers' Qwen3MoeConfig.
TINY_QWEN3_MOE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # a head size vLLM's CPU attention supports
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

# The mini Qwen3-MoE (recipes/local/task/hf_checkpoints.py builds it with shape="mini"): Qwen3-30B-A3B's
# routing at full count (128 experts, top-8, renormalised) and its attention's heads (32 query,
# 4 KV: GQA 8:1, so the mission's tp 4 divides them) with qk-norm, at a width CPUs train
# (4 layers: pp 2 and 4 divide them). Every size is one vLLM's
# CPU backend serves (recipes/local/cpu/rollout_limits.py: head_dim 32, hidden and expert slices
# multiples of 32); the vocabulary and special ids are the toy task's character tokenizer's
# (recipes/local/task/doubles.py: VOCAB_SIZE, <|endoftext|> 0, <|im_end|> 2; a test checks both).
MINI_QWEN3_MOE = dict(
    vocab_size=32,
    hidden_size=128,
    intermediate_size=384,  # dense MLP size as in the real model (3 x hidden); no layer uses it
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=32,  # Qwen3-30B-A3B's 32 query / 4 KV heads: tp 1, 2 and 4 are legal
    num_key_value_heads=4,
    head_dim=32,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=2,
)

DEFAULT_MODEL_NAME = "Qwen3-30B-A3B"


def load_spec(model: str | None = None) -> Qwen3MoeSpec:
    """Spec from an HF config.json path or checkpoint dir; the embedded Qwen3-30B-A3B if None."""
    return load_qwen3_moe_spec(QWEN3_30B_A3B if model is None else model)
