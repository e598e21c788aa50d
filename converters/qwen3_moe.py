"""Qwen3-MoE name table between Hugging Face and megatron-core (local layer spec).

One row per megatron-core tensor: its name, the HF tensors it is made of, and how
they combine. `{layer}` and `{expert}` are placeholders; the expert index in an HF
name is global, in an mcore name it is the rank-local index (`ExpertSlice`).

HF comes in two layouts, both handled:
- hub / on disk: one key per expert and projection (`mlp.experts.{e}.gate_proj.weight`),
- transformers 5 in memory: experts fused (`mlp.experts.gate_up_proj` [E, 2I, H] with
  the gate rows first, `mlp.experts.down_proj` [E, H, I]).
`unfuse_experts` / `fuse_experts` move between them; the table speaks the hub layout.
"""

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from backend.hf_config import Qwen3MoeSpec

HF_LAYER = "model.layers.{layer}."
MC_LAYER = "decoder.layers.{layer}."


@dataclass(frozen=True)
class Row:
    mcore: str
    hf: tuple[str, ...]
    how: str = "copy"  # copy | qkv (fused per query group) | gate_up (fc1 = cat(gate, up))


NAME_TABLE: tuple[Row, ...] = (
    Row("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
    Row("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Row("output_layer.weight", ("lm_head.weight",)),
    Row(MC_LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",)),
    Row(
        MC_LAYER + "self_attention.linear_qkv.weight",
        tuple(HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
        "qkv",
    ),
    Row(MC_LAYER + "self_attention.linear_proj.weight", (HF_LAYER + "self_attn.o_proj.weight",)),
    Row(MC_LAYER + "self_attention.q_layernorm.weight", (HF_LAYER + "self_attn.q_norm.weight",)),
    Row(MC_LAYER + "self_attention.k_layernorm.weight", (HF_LAYER + "self_attn.k_norm.weight",)),
    Row(MC_LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",)),
    Row(MC_LAYER + "mlp.router.weight", (HF_LAYER + "mlp.gate.weight",)),
    Row(
        MC_LAYER + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
        (
            HF_LAYER + "mlp.experts.{expert}.gate_proj.weight",
            HF_LAYER + "mlp.experts.{expert}.up_proj.weight",
        ),
        "gate_up",
    ),
    Row(
        MC_LAYER + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
        (HF_LAYER + "mlp.experts.{expert}.down_proj.weight",),
    ),
)

# Ignored HF keys: buffers some exporters write that the model recomputes.
HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class MappingError(KeyError):
    """Weights missing, left over, or of the wrong shape for the model."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclass(frozen=True)
class ExpertSlice:
    """The experts one EP rank holds: global index = ep_rank * num_local + local index."""

    num_experts: int
    ep_size: int = 1
    ep_rank: int = 0

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep_size

    def global_index(self, local: int) -> int:
        return self.ep_rank * self.num_local + local


# ---- special cases ------------------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: Qwen3MoeSpec) -> torch.Tensor:
    """[q; k; v] -> mcore's layout: per query group, its q heads, then its k head, then v."""
    g, d = spec.num_kv_heads, spec.head_dim
    q = q.reshape(g, spec.heads_per_group * d, -1)
    k, v = k.reshape(g, d, -1), v.reshape(g, d, -1)
    return torch.cat((q, k, v), dim=1).reshape(-1, q.shape[-1])


def split_qkv(qkv: torch.Tensor, spec: Qwen3MoeSpec) -> tuple[torch.Tensor, ...]:
    """Inverse of fuse_qkv."""
    g, d, hpg = spec.num_kv_heads, spec.head_dim, spec.heads_per_group
    grouped = qkv.reshape(g, (hpg + 2) * d, -1)
    q, k, v = torch.split(grouped, (hpg * d, d, d), dim=1)
    hidden = qkv.shape[-1]
    return tuple(t.reshape(-1, hidden).contiguous() for t in (q, k, v))


def combine_row(row: Row, parts: list[torch.Tensor], spec: Qwen3MoeSpec) -> torch.Tensor:
    """The HF tensors of a row (in row.hf order) -> its one mcore tensor."""
    if row.how == "qkv":
        return fuse_qkv(*parts, spec)
    if row.how == "gate_up":
        return torch.cat(parts, dim=0)
    return parts[0]


def split_row(row: Row, tensor: torch.Tensor, spec: Qwen3MoeSpec) -> tuple[torch.Tensor, ...]:
    """One mcore tensor -> its HF tensors, in the order of row.hf."""
    if row.how == "qkv":
        return split_qkv(tensor, spec)
    if row.how == "gate_up":
        return tuple(t.contiguous() for t in tensor.chunk(2, dim=0))
    return (tensor,)


# ---- table expansion --------------------------------------------------------------


def expand_table(
    spec: Qwen3MoeSpec, experts: ExpertSlice | None = None
) -> Iterator[tuple[Row, str, tuple[str, ...]]]:
    """Every (row, mcore name, hf names) for the model, with placeholders filled."""
    experts = experts or ExpertSlice(spec.num_experts)
    for row in NAME_TABLE:
        layers = range(spec.num_layers) if "{layer}" in row.mcore else (None,)
        locals_ = range(experts.num_local) if "{expert}" in row.mcore else (None,)
        for layer in layers:
            for local in locals_:
                glob = None if local is None else experts.global_index(local)
                mcore = row.mcore.format(layer=layer, expert=local)
                hf = tuple(h.format(layer=layer, expert=glob) for h in row.hf)
                yield row, mcore, hf


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


# ---- conversion -------------------------------------------------------------------


def _missing(names: list[str], what: str, fix: str) -> MappingError:
    shown = ", ".join(names[:3]) + (f" (and {len(names) - 3} more)" if len(names) > 3 else "")
    return MappingError(f"{what}: {shown}; {fix}")


def hf_to_mcore(
    hf: Mapping[str, torch.Tensor], spec: Qwen3MoeSpec, experts: ExpertSlice | None = None
) -> dict[str, torch.Tensor]:
    """HF state dict (either layout) -> mcore local-spec state dict (world size 1 or one EP slice)."""
    hf = unfuse_experts(hf) if has_fused_experts(hf) else hf
    out, used = {}, set()
    missing: list[str] = []
    for row, mcore, hf_names in expand_table(spec, experts):
        absent = [n for n in hf_names if n not in hf]
        if absent:
            missing.extend(absent)
            continue
        out[mcore] = combine_row(row, [hf[n] for n in hf_names], spec)
        used.update(hf_names)
    if missing:
        raise _missing(
            missing,
            "HF checkpoint lacks weights",
            "is the checkpoint complete and for this config?",
        )
    full_slice = experts is None or experts.ep_size == 1
    extra = sorted(n for n in hf if n not in used and not HF_IGNORED.match(n))
    if extra and full_slice:
        raise _missing(
            extra,
            "HF checkpoint has weights this Qwen3-MoE config does not use",
            "does config.json (layers, experts) match the weights?",
        )
    return out


def mcore_to_hf(
    mcore: Mapping[str, torch.Tensor],
    spec: Qwen3MoeSpec,
    fused_experts: bool = False,
    experts: ExpertSlice | None = None,
) -> dict[str, torch.Tensor]:
    """mcore local-spec state dict -> HF (hub layout, or transformers 5 fused with fused_experts)."""
    out: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for row, name, hf_names in expand_table(spec, experts):
        if name not in mcore:
            missing.append(name)
            continue
        out.update(zip(hf_names, split_row(row, mcore[name], spec), strict=True))
    if missing:
        raise _missing(
            missing, "megatron-core state dict lacks tensors", "was it saved from this config?"
        )
    return fuse_experts(out) if fused_experts else out


def load_hf_into_model(
    model: torch.nn.Module,
    hf: Mapping[str, torch.Tensor],
    spec: Qwen3MoeSpec,
    experts: ExpertSlice | None = None,
) -> None:
    """Copy HF weights into an mcore model in place; every parameter must be covered, shapes must agree."""
    from converters.sharding import expanded_parameters

    converted = hf_to_mcore(hf, spec, experts)
    params = {name: param for name, param, _ in expanded_parameters(model)}
    uncovered = sorted(set(params) - set(converted))
    if uncovered:
        raise _missing(
            uncovered,
            "model parameters with no HF source",
            "is the model built from the same config?",
        )
    with torch.no_grad():
        for name, param in params.items():
            src = converted[name]
            if src.shape != param.shape:
                raise MappingError(
                    f"{name}: HF gives shape {tuple(src.shape)}, model expects {tuple(param.shape)}; "
                    "config.json and the weights disagree"
                )
            param.copy_(src)


def model_to_hf(
    model: torch.nn.Module, spec: Qwen3MoeSpec, fused_experts: bool = False
) -> dict[str, torch.Tensor]:
    """HF state dict of an mcore model's parameters (world size 1)."""
    from converters.sharding import expanded_parameters

    params = {name: value for name, _, value in expanded_parameters(model)}
    return mcore_to_hf(params, spec, fused_experts)
