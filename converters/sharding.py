"""TP / EP / PP slicing between full (world-size-1) mcore tensors and one rank's parameters.

One generic layer for every converter: the model family's mappings (backend.model.weight_mappings,
listed in backend/<model_type>/) say what a full mcore tensor is made of and, each for its
own tensor, which part of it a TP rank holds; this module asks them.
- TP: megatron tags split parameters with `tensor_model_parallel` and `partition_dim`;
  the mapping says over which group (`tp_group`: expert-TP for `is_expert`, else TP) and
  how (contiguous, or GLU fc1's cat(gate_r, up_r)).
- EP: local expert j is global expert ep_rank * E/ep + j (converters.table.ExpertSlice).
- PP: stage-local layer i is global layer `layer_number - 1` of that TransformerLayer.
- Grouped experts (backend.model.experts) are walked per expert under SequentialMLP's names
  (`expanded_parameters`), so one table serves both expert modules.
A model at world size 1 (`load_hf_into_model`, `model_to_hf`) is the case of no slicing;
converters.table below works on state dicts alone and never sees a model.
"""

import re
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from backend.model.weight_mappings import Mapping as WeightMapping
from backend.training.distributed import ProcessGroups
from converters.table import (
    ExpertSlice,
    MappingError,
    hf_to_mcore,
    mcore_to_hf,
    missing_error,
    rows_by_name,
)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _grad(param: torch.Tensor) -> torch.Tensor:
    main_grad = getattr(param, "main_grad", None)
    if main_grad is not None:  # a view of DDP's grad buffer, which zero_grad_buffer() clears
        return main_grad.detach().clone()
    return param.grad.detach() if param.grad is not None else torch.zeros_like(param)


def expanded_parameters(
    model: torch.nn.Module, grads: bool = False
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, parameter, value) like named_parameters, with grouped experts split per expert.

    value is the parameter's data, or its gradient (zeros where none) with grads=True: under
    megatron-core's DDP the gradient accumulates in `main_grad` (its buffer), else `.grad`. Modules
    holding stacked experts (backend.model.experts.GroupedExperts) name and slice them through their
    `expert_slices`: SequentialMLP's names, per-expert views carrying its TP attributes.
    """
    stacked = {name: m for name, m in model.named_modules() if hasattr(m, "expert_slices")}
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        value = param.detach() if not grads else _grad(param)
        if owner in stacked:
            yield from stacked[owner].expert_slices(owner + ".", leaf, value)
        else:
            yield name, param, value


def expert_slice(spec, groups: ProcessGroups) -> ExpertSlice:
    return ExpertSlice(spec.num_experts, groups.size("ep"), groups.rank("ep"))


def layer_offsets(model: torch.nn.Module) -> dict[int, int]:
    """Stage-local layer index -> global 0-based layer index."""
    return {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}


def global_name(name: str, offsets: Mapping[int, int]) -> str:
    """A stage-local parameter name with its layer index made global (identity at pp=1)."""
    match = _LAYER.match(name)
    if not match:
        return name
    return f"decoder.layers.{offsets[int(match.group(1))]}." + name[match.end() :]


def shard(
    full: torch.Tensor, mapping: WeightMapping, param: torch.Tensor, groups: ProcessGroups
) -> torch.Tensor:
    """This rank's part of a full tensor, for the parameter `param` that `mapping` maps."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    group = mapping.tp_group
    return mapping.shard(full, param.partition_dim, groups.rank(group), groups.size(group))


def unshard(
    local: torch.Tensor, mapping: WeightMapping, param: torch.Tensor, groups: ProcessGroups
) -> torch.Tensor:
    """Inverse of shard: all-gather a TP/ETP-split tensor into the full one (collective)."""
    if not getattr(param, "tensor_model_parallel", False):
        return local
    group = mapping.tp_group
    size = groups.size(group)
    if size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=getattr(groups, group))
    return mapping.unshard(parts, param.partition_dim)


def _mapping(rows: dict, key: str, name: str) -> WeightMapping:
    if key not in rows:
        raise MappingError(
            f"model parameter {name} has no HF mapping: is the model built from the same "
            "config, with the local layer spec?"
        )
    return rows[key][0]


def load_hf_into_model(
    model: torch.nn.Module,
    hf: Mapping[str, torch.Tensor],
    spec,
    experts: ExpertSlice | None = None,
) -> None:
    """Copy HF weights into an mcore model in place; every parameter must be covered, shapes must agree."""
    converted = hf_to_mcore(hf, spec, experts)
    params = {name: param for name, param, _ in expanded_parameters(model)}
    uncovered = sorted(set(params) - set(converted))
    if uncovered:
        raise missing_error(
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
    model: torch.nn.Module, spec, fused_experts: bool = False
) -> dict[str, torch.Tensor]:
    """HF state dict of an mcore model's parameters (world size 1)."""
    params = {name: value for name, _, value in expanded_parameters(model)}
    return mcore_to_hf(params, spec, fused_experts)


def load_hf_sharded(
    model: torch.nn.Module,
    hf: Mapping[str, torch.Tensor],
    spec,
    groups: ProcessGroups,
) -> None:
    """Copy HF weights into this rank's (TP/EP/PP-sharded) mcore model in place."""
    experts = expert_slice(spec, groups)
    full, rows = hf_to_mcore(hf, spec, experts), rows_by_name(spec, experts)
    offsets = layer_offsets(model)
    with torch.no_grad():
        for name, param, _ in expanded_parameters(model):
            key = global_name(name, offsets)
            if key not in full:
                raise MappingError(
                    f"model parameter {name} has no HF source: is the model built from the same config?"
                )
            local = shard(full[key], rows[key][0], param, groups)
            if local.shape != param.shape:
                raise MappingError(
                    f"{name}: HF gives shape {tuple(local.shape)} on this rank, model expects "
                    f"{tuple(param.shape)}; config.json and the weights disagree"
                )
            param.copy_(local)


def iter_full(
    model: torch.nn.Module, groups: ProcessGroups, spec, grads: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(world-size-1 mcore name, full tensor) of this PP stage, one tensor at a time.

    Params (or their .grad) gathered over TP/ETP, and over EP for experts (one tensor per
    expert). Collective: every rank of the stage iterates to the end.
    """
    offsets, ep = layer_offsets(model), groups.size("ep")
    rows = rows_by_name(spec, expert_slice(spec, groups))
    for name, param, tensor in expanded_parameters(model, grads):
        key = global_name(name, offsets)
        mapping = _mapping(rows, key, name)
        full = unshard(tensor, mapping, param, groups)
        if not mapping.is_expert:
            yield key, full
            continue
        parts = [full]
        if ep > 1:
            parts = [torch.empty_like(full) for _ in range(ep)]
            dist.all_gather(parts, full.contiguous(), group=groups.ep)
        for ep_rank, part in enumerate(parts):
            yield global_expert_name(key, ExpertSlice(spec.num_experts, ep, ep_rank)), part


_EXPERT = re.compile(r"(\.local_experts\.)(\d+)(\.)")


def global_expert_name(name: str, experts: ExpertSlice) -> str:
    """`...local_experts.{j}...` with the rank-local expert index made global."""
    return _EXPERT.sub(lambda m: f"{m[1]}{experts.global_index(int(m[2]))}{m[3]}", name)
