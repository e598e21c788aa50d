"""Qwen3-MoE as a megatron-core GPTModel: its TransformerConfig fields and layer spec.

Qwen3's router is softmax over all experts, top-k, renormalised over the k when
`norm_topk_prob`. megatron-core's TopKRouter with pre_softmax=False takes the top-k
logits and softmaxes over them, which is the same renormalised distribution;
pre_softmax=True (softmax then top-k, no renormalisation) is norm_topk_prob=False.

backend.model.build builds the model from these (parallelism, dtype, fusions and recompute are
its own); `backend.model.build.with_fast_modules` swaps our experts / attention into the local spec.
"""

import torch.nn.functional as F

from backend.qwen3_moe.config import Qwen3MoeSpec


def transformer_config_kwargs(spec: Qwen3MoeSpec) -> dict:
    """The TransformerConfig fields the model decides: shape, norms, attention, router."""
    return dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        qk_layernorm=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.top_k,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not spec.norm_topk_prob,
    )


def gpt_model_kwargs(spec: Qwen3MoeSpec) -> dict:
    """GPTModel arguments the model decides: untied head, RoPE."""
    return dict(
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(spec.rope_theta),
    )


def layer_spec(spec: Qwen3MoeSpec, opts, groups):
    """Layer spec: TransformerEngine modules ('te') or megatron-core's local ones ('local'),
    the latter with our grouped experts / SDPA attention swapped in as `opts` asks."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from backend.model.build import with_fast_modules

    if opts.resolved_spec() == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=spec.num_experts, moe_grouped_gemm=True, qk_layernorm=True
        )
    local = specs.get_gpt_layer_local_spec(
        num_experts=spec.num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=True,
        normalization="RMSNorm",
    )
    return with_fast_modules(local, opts, groups)
