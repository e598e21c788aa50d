"""Weight mapping objects: one megatron-core tensor, the HF tensors it is made of, and how.

Each mapping owns its three rules together (as Megatron-Bridge's DirectMapping, QKVMapping
and GatedMLPMapping do):
- `combine`: HF tensors (in `hf` order) -> the full (world-size-1) mcore tensor,
- `split`: the inverse, mcore tensor -> HF tensors,
- `shard` / `unshard`: which part of the full tensor a TP rank holds, along the parameter's
  `partition_dim` (megatron tags TP-split parameters `tensor_model_parallel`), and back.
`is_expert` marks per-expert tensors: one per expert (EP slices them; the `{expert}`
placeholder), split over the expert-TP group (`tp_group`), replicated over expert-DP.

A model folder (backend/<model_type>/) lists its mappings with `{layer}` / `{expert}`
placeholders in both names: the expert index is global in an HF name, rank-local in an mcore one.
They live with the model folders that list them; the converters read them from here.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mapping:
    mcore: str
    hf: tuple[str, ...]
    is_expert: bool = False

    def __post_init__(self) -> None:
        if self.is_expert != ("{expert}" in self.mcore):
            raise ValueError(
                f"{self.mcore}: is_expert={self.is_expert} but the name says otherwise"
            )

    @property
    def tp_group(self) -> str:
        """The ProcessGroups name the tensor is split over."""
        return "etp" if self.is_expert else "tp"

    def combine(self, parts: list[torch.Tensor], spec) -> torch.Tensor:
        raise NotImplementedError

    def split(self, tensor: torch.Tensor, spec) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def shard(self, full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
        """TP rank `rank` of `size`'s part of the full tensor: a contiguous slice along dim."""
        return full.chunk(size, dim=dim)[rank]

    def unshard(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Every TP rank's part, in rank order -> the full tensor (inverse of shard)."""
        return torch.cat(parts, dim=dim)


@dataclass(frozen=True)
class DirectMapping(Mapping):
    """One HF tensor is the mcore tensor."""

    def combine(self, parts: list[torch.Tensor], spec) -> torch.Tensor:
        return parts[0]

    def split(self, tensor: torch.Tensor, spec) -> tuple[torch.Tensor, ...]:
        return (tensor,)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec) -> torch.Tensor:
    """[q; k; v] -> mcore's layout: per query group, its q heads, then its k head, then v."""
    g, d = spec.num_kv_heads, spec.head_dim
    q = q.reshape(g, spec.heads_per_group * d, -1)
    k, v = k.reshape(g, d, -1), v.reshape(g, d, -1)
    return torch.cat((q, k, v), dim=1).reshape(-1, q.shape[-1])


def split_qkv(qkv: torch.Tensor, spec) -> tuple[torch.Tensor, ...]:
    """Inverse of fuse_qkv."""
    g, d, hpg = spec.num_kv_heads, spec.head_dim, spec.heads_per_group
    grouped = qkv.reshape(g, (hpg + 2) * d, -1)
    q, k, v = torch.split(grouped, (hpg * d, d, d), dim=1)
    hidden = qkv.shape[-1]
    return tuple(t.reshape(-1, hidden).contiguous() for t in (q, k, v))


@dataclass(frozen=True)
class QKVMapping(Mapping):
    """HF q, k, v projections -> mcore's linear_qkv, fused per query group (spec's
    num_kv_heads, head_dim, heads_per_group). A contiguous TP slice is whole query groups,
    so sharding is the plain one."""

    def combine(self, parts: list[torch.Tensor], spec) -> torch.Tensor:
        return fuse_qkv(*parts, spec)

    def split(self, tensor: torch.Tensor, spec) -> tuple[torch.Tensor, ...]:
        return split_qkv(tensor, spec)


@dataclass(frozen=True)
class GatedMLPMapping(Mapping):
    """HF gate and up projections -> mcore's GLU linear_fc1 = cat(gate, up). Each TP rank
    holds cat(gate_r, up_r), not a contiguous slice of the full tensor."""

    def combine(self, parts: list[torch.Tensor], spec) -> torch.Tensor:
        return torch.cat(parts, dim=0)

    def split(self, tensor: torch.Tensor, spec) -> tuple[torch.Tensor, ...]:
        return tuple(t.contiguous() for t in tensor.chunk(2, dim=0))

    def shard(self, full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
        gate, up = full.chunk(2, dim=dim)
        return torch.cat((gate.chunk(size, dim=dim)[rank], up.chunk(size, dim=dim)[rank]), dim=dim)

    def unshard(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        halves = [p.chunk(2, dim=dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
