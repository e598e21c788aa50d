"""Qwen3-MoE (HF model_type "qwen3_moe"): everything this backend knows about the model.

- config: `Qwen3MoeSpec`, `load_qwen3_moe_spec` (HF config.json -> validated spec),
- megatron: its megatron-core TransformerConfig fields, GPTModel arguments and layer spec,
- mapping: HF <-> mcore weight mappings (backend.model.weight_mappings objects), fused HF experts,
- params: parameter counts,
- family: `FAMILY`, the backend.model.families.ModelFamily the generic code looks up by model_type.
"""

from backend.model.families import ConfigError
from backend.qwen3_moe.config import MODEL_TYPE, Qwen3MoeSpec, load_qwen3_moe_spec
from backend.qwen3_moe.family import FAMILY
from backend.qwen3_moe.mapping import fuse_experts, has_fused_experts, unfuse_experts

__all__ = [
    "FAMILY",
    "MODEL_TYPE",
    "ConfigError",
    "Qwen3MoeSpec",
    "fuse_experts",
    "has_fused_experts",
    "load_qwen3_moe_spec",
    "unfuse_experts",
]
