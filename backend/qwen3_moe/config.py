"""Read and validate a Hugging Face Qwen3-MoE config into one frozen spec.

Accepts a `Qwen3MoeConfig`, a dict, a config.json path or a checkpoint directory,
and both spellings transformers has used: `num_experts` / `num_local_experts` and
`rope_theta` / `rope_parameters.rope_theta`.
"""

from dataclasses import dataclass
from typing import Any, ClassVar

from backend.model.families import ConfigError, read_config

MODEL_TYPE = "qwen3_moe"


@dataclass(frozen=True)
class Qwen3MoeSpec:
    model_type: ClassVar[str] = MODEL_TYPE  # its family: backend.model.families.family_of

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_ffn_hidden_size: int
    ffn_hidden_size: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    router_aux_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "num_experts",
            "top_k",
            "moe_ffn_hidden_size",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be a positive integer")
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.top_k} exceeds num_experts={self.num_experts}: "
                "each token needs that many distinct experts"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not divisible by "
                f"num_key_value_heads={self.num_kv_heads}: GQA needs whole query groups"
            )

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _first(cfg: dict, *keys: str) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    raise ConfigError(
        f"config has no {' / '.join(keys)}: is this a complete Qwen3-MoE config.json?"
    )


def _rope_theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConfigError(
            f"rope type {rope_type!r} is not supported yet: only default RoPE (Qwen3-MoE as released)"
        )
    if cfg.get("rope_theta") is not None:
        return float(cfg["rope_theta"])
    if rope.get("rope_theta") is not None:
        return float(rope["rope_theta"])
    raise ConfigError("config has neither rope_theta nor rope_parameters.rope_theta")


def _check_architecture(cfg: dict) -> None:
    if cfg.get("model_type") != MODEL_TYPE:
        raise ConfigError(
            f"model_type is {cfg.get('model_type')!r}, expected {MODEL_TYPE!r}: "
            "this backend builds Qwen3-MoE models only"
        )
    if cfg.get("tie_word_embeddings", False):
        raise ConfigError(
            "tie_word_embeddings=true is not supported: Qwen3-MoE has an untied lm_head"
        )
    if cfg.get("attention_bias", False):
        raise ConfigError("attention_bias=true is not supported: Qwen3-MoE attention has no biases")
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(
            "dense layers (mlp_only_layers / decoder_sparse_step != 1) are not supported: "
            "every Qwen3-MoE release uses experts in all layers"
        )


def load_qwen3_moe_spec(source: Any) -> Qwen3MoeSpec:
    """Validated spec from a Qwen3MoeConfig, dict, config.json path or checkpoint dir."""
    return spec_from_config(read_config(source))


def spec_from_config(cfg: dict) -> Qwen3MoeSpec:
    """Validated spec from a config.json dict."""
    _check_architecture(cfg)
    num_heads = int(_first(cfg, "num_attention_heads"))
    hidden = int(_first(cfg, "hidden_size"))
    return Qwen3MoeSpec(
        vocab_size=int(_first(cfg, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_first(cfg, "num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(_first(cfg, "num_key_value_heads")),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        num_experts=int(_first(cfg, "num_experts", "num_local_experts")),
        top_k=int(_first(cfg, "num_experts_per_tok")),
        moe_ffn_hidden_size=int(_first(cfg, "moe_intermediate_size")),
        ffn_hidden_size=int(cfg.get("intermediate_size") or _first(cfg, "moe_intermediate_size")),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
    )
