"""Qwen3-MoE weights between Hugging Face and megatron-core (local layer spec).

One mapping per megatron-core tensor (backend.model.weight_mappings: combine, split and TP sharding
together). HF comes in two layouts, both handled:
- hub / on disk: one key per expert and projection (`mlp.experts.{e}.gate_proj.weight`),
- transformers 5 in memory: experts fused (`mlp.experts.gate_up_proj` [E, 2I, H] with
  the gate rows first, `mlp.experts.down_proj` [E, H, I]).
`unfuse_experts` / `fuse_experts` move between them; the mappings speak the hub layout.
"""

import re
from collections.abc import Mapping

import torch

from backend.model.weight_mappings import DirectMapping, GatedMLPMapping, QKVMapping

HF_LAYER = "model.layers.{layer}."
MC_LAYER = "decoder.layers.{layer}."


def _direct(mcore: str, hf: str) -> DirectMapping:
    return DirectMapping(mcore, (hf,))


MAPPINGS = (
    _direct("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    _direct("decoder.final_layernorm.weight", "model.norm.weight"),
    _direct("output_layer.weight", "lm_head.weight"),
    _direct(MC_LAYER + "input_layernorm.weight", HF_LAYER + "input_layernorm.weight"),
    QKVMapping(
        MC_LAYER + "self_attention.linear_qkv.weight",
        tuple(HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
    ),
    _direct(MC_LAYER + "self_attention.linear_proj.weight", HF_LAYER + "self_attn.o_proj.weight"),
    _direct(MC_LAYER + "self_attention.q_layernorm.weight", HF_LAYER + "self_attn.q_norm.weight"),
    _direct(MC_LAYER + "self_attention.k_layernorm.weight", HF_LAYER + "self_attn.k_norm.weight"),
    _direct(MC_LAYER + "pre_mlp_layernorm.weight", HF_LAYER + "post_attention_layernorm.weight"),
    _direct(MC_LAYER + "mlp.router.weight", HF_LAYER + "mlp.gate.weight"),
    GatedMLPMapping(
        MC_LAYER + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
        (
            HF_LAYER + "mlp.experts.{expert}.gate_proj.weight",
            HF_LAYER + "mlp.experts.{expert}.up_proj.weight",
        ),
        is_expert=True,
    ),
    DirectMapping(
        MC_LAYER + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
        (HF_LAYER + "mlp.experts.{expert}.down_proj.weight",),
        is_expert=True,
    ),
)

# Ignored HF keys: buffers some exporters write that the model recomputes.
HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


# ---- fused (transformers 5 in-memory) experts ---------------------------------------

_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$"
)


def unfuse_experts(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 fused expert tensors -> hub per-expert keys; other keys untouched."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf.items():
        match = _FUSED.match(name)
        if not match:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        for e, t in enumerate(tensor.unbind(0)):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = t.contiguous()
            else:
                gate, up = t.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
    return out


def fuse_experts(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hub per-expert keys -> transformers 5 fused tensors; other keys untouched."""
    out: dict[str, torch.Tensor] = {}
    grouped: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in hf.items():
        match = _PER_EXPERT.match(name)
        if match:
            prefix, e, kind = match.groups()
            grouped.setdefault(prefix, {}).setdefault(kind, {})[int(e)] = tensor
        else:
            out[name] = tensor
    for prefix, kinds in grouped.items():
        order = sorted(kinds["down"])
        gate_up = [torch.cat((kinds["gate"][e], kinds["up"][e]), dim=0) for e in order]
        out[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{prefix}.down_proj"] = torch.stack([kinds["down"][e] for e in order])
    return out


def has_fused_experts(hf: Mapping[str, torch.Tensor]) -> bool:
    return any(_FUSED.match(name) for name in hf)
