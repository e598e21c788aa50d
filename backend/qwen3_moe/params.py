"""Parameter counts of a Qwen3-MoE model, from its spec or a built transformers model."""

from backend.model.families import ParamCounts
from backend.qwen3_moe.config import Qwen3MoeSpec


def param_counts(spec: Qwen3MoeSpec, vocab: int | None = None) -> ParamCounts:
    h, hd = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    vocab = vocab or spec.vocab_size
    return ParamCounts(
        embedding=vocab * h,
        lm_head=vocab * h,
        final_norm=h,
        attention=h * (q + 2 * kv) + q * h + 2 * hd,
        layer_norms=2 * h,
        router=spec.num_experts * h,
        expert=3 * h * spec.moe_ffn_hidden_size,
        num_layers=spec.num_layers,
        num_experts=spec.num_experts,
        top_k=spec.top_k,
        attention_replicated=2 * hd,  # q/k norms (per head, replicated across TP)
    )


def hf_param_counts(model) -> tuple[int, int]:
    """(total, active) parameters of a built transformers Qwen3MoeForCausalLM.

    Expert weights are those of each layer's `mlp.experts`; a token uses top_k of them.
    """
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for layer in model.model.layers for p in layer.mlp.experts.parameters())
    num_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    active = total - experts + experts * cfg.num_experts_per_tok // num_experts
    return total, active
