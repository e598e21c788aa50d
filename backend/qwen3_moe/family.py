"""The Qwen3-MoE family as the generic code sees it (backend.model.families finds it by model_type)."""

import backend.qwen3_moe.mapping as mapping
import backend.qwen3_moe.megatron as megatron
import backend.qwen3_moe.params as params
from backend.model.families import ModelFamily
from backend.qwen3_moe.config import MODEL_TYPE, spec_from_config

FAMILY = ModelFamily(
    model_type=MODEL_TYPE,
    name="Qwen3-MoE",
    architectures=("Qwen3MoeForCausalLM",),
    spec_from_config=spec_from_config,
    transformer_config_kwargs=megatron.transformer_config_kwargs,
    gpt_model_kwargs=megatron.gpt_model_kwargs,
    layer_spec=megatron.layer_spec,
    mappings=mapping.MAPPINGS,
    hf_ignored=mapping.HF_IGNORED,
    unfuse_hf=mapping.unfuse_experts,
    fuse_hf=mapping.fuse_experts,
    has_fused_hf=mapping.has_fused_experts,
    param_counts=params.param_counts,
    hf_param_counts=params.hf_param_counts,
    hf_shapes=params.hf_shapes,
)
