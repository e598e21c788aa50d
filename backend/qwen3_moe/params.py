"""Parameter counts and HF tensor shapes of a Qwen3-MoE model, from its spec or a built model."""

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


def hf_shapes(spec: Qwen3MoeSpec, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the config implies -> its shape: the hub layout (one tensor per expert
    and projection), or transformers 5's fused experts (`gate_up_proj` [E, 2I, H], gate rows
    first, and `down_proj` [E, H, I]) when `fused`."""
    h, hd, e, i = spec.hidden_size, spec.head_dim, spec.num_experts, spec.moe_ffn_hidden_size
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    shapes = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (spec.vocab_size, h),
    }
    for layer in range(spec.num_layers):
        at = f"model.layers.{layer}."
        shapes |= {
            at + "input_layernorm.weight": (h,),
            at + "post_attention_layernorm.weight": (h,),
            at + "self_attn.q_proj.weight": (q, h),
            at + "self_attn.k_proj.weight": (kv, h),
            at + "self_attn.v_proj.weight": (kv, h),
            at + "self_attn.o_proj.weight": (h, q),
            at + "self_attn.q_norm.weight": (hd,),
            at + "self_attn.k_norm.weight": (hd,),
            at + "mlp.gate.weight": (e, h),
        }
        if fused:
            shapes[at + "mlp.experts.gate_up_proj"] = (e, 2 * i, h)
            shapes[at + "mlp.experts.down_proj"] = (e, h, i)
            continue
        for x in range(e):
            shapes[at + f"mlp.experts.{x}.gate_proj.weight"] = (i, h)
            shapes[at + f"mlp.experts.{x}.up_proj.weight"] = (i, h)
            shapes[at + f"mlp.experts.{x}.down_proj.weight"] = (h, i)
    return shapes
