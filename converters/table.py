"""HF <-> megatron-core (local layer spec) state dicts, through a model family's mappings
(state dicts only: loading into a model and reading one out are converters.sharding's).

The model folder (backend/<model_type>/, found from the spec: backend.model.families) lists one
mapping per mcore tensor (backend.model.weight_mappings): its name, the HF tensors it is made of, and
how they combine. `{layer}` and `{expert}` are placeholders; the expert index in an HF name
is global, in an mcore name it is the rank-local index (`ExpertSlice`).

The mappings speak HF's hub layout (one key per expert and projection); a family whose
transformers model fuses experts in memory (Qwen3-MoE under transformers 5) converts that
layout with its `unfuse_hf` / `fuse_hf`, and both layouts are accepted.
"""

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from backend.model.families import family_of
from backend.model.weight_mappings import Mapping as WeightMapping


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


def combine_row(row: WeightMapping, parts: list[torch.Tensor], spec) -> torch.Tensor:
    """The HF tensors of a mapping (in row.hf order) -> its one mcore tensor."""
    return row.combine(parts, spec)


def split_row(row: WeightMapping, tensor: torch.Tensor, spec) -> tuple[torch.Tensor, ...]:
    """One mcore tensor -> its HF tensors, in the order of row.hf."""
    return row.split(tensor, spec)


# ---- table expansion --------------------------------------------------------------


def expand_table(
    spec, experts: ExpertSlice | None = None
) -> Iterator[tuple[WeightMapping, str, tuple[str, ...]]]:
    """Every (row, mcore name, hf names) for the model, with placeholders filled."""
    experts = experts or ExpertSlice(spec.num_experts)
    for row in family_of(spec).mappings:
        layers = range(spec.num_layers) if "{layer}" in row.mcore else (None,)
        locals_ = range(experts.num_local) if row.is_expert else (None,)
        for layer in layers:
            for local in locals_:
                glob = None if local is None else experts.global_index(local)
                mcore = row.mcore.format(layer=layer, expert=local)
                hf = tuple(h.format(layer=layer, expert=glob) for h in row.hf)
                yield row, mcore, hf


# ---- conversion -------------------------------------------------------------------


def missing_error(names: list[str], what: str, fix: str) -> MappingError:
    """`what`, the first names of `names` (and how many more), and the `fix`."""
    shown = ", ".join(names[:3]) + (f" (and {len(names) - 3} more)" if len(names) > 3 else "")
    return MappingError(f"{what}: {shown}; {fix}")


def hf_to_mcore(
    hf: Mapping[str, torch.Tensor], spec, experts: ExpertSlice | None = None
) -> dict[str, torch.Tensor]:
    """HF state dict (either layout) -> mcore local-spec state dict (world size 1 or one EP slice)."""
    family = family_of(spec)
    hf = family.unfuse_hf(hf) if family.has_fused_hf(hf) else hf
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
        raise missing_error(
            missing,
            "HF checkpoint lacks weights",
            "is the checkpoint complete and for this config?",
        )
    full_slice = experts is None or experts.ep_size == 1
    extra = sorted(n for n in hf if n not in used and not family.hf_ignored.match(n))
    if extra and full_slice:
        raise missing_error(
            extra,
            f"HF checkpoint has weights this {family.name} config does not use",
            "does config.json (layers, experts) match the weights?",
        )
    return out


def mcore_to_hf(
    mcore: Mapping[str, torch.Tensor],
    spec,
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
        raise missing_error(
            missing, "megatron-core state dict lacks tensors", "was it saved from this config?"
        )
    return family_of(spec).fuse_hf(out) if fused_experts else out


def rows_by_name(spec, experts: ExpertSlice | None = None) -> dict:
    """mcore parameter name -> (its mapping, its HF tensor names)."""
    return {mcore: (row, hf) for row, mcore, hf in expand_table(spec, experts)}
