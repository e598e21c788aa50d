"""Grouped-GEMM experts for megatron-core's MoE layer, without TransformerEngine.

`GroupedExperts` replaces SequentialMLP in the layer spec (`experts=ModuleSpec(...)`): all
local experts run as two grouped GEMMs (backend.model.grouped_gemm) around a SwiGLU weighted by
the router probabilities, instead of a Python loop of small matmuls.

Parameters are stacked per local expert, in SequentialMLP's per-expert layout:
  weight1 [E_local, 2 * F / etp, H]  = each expert's linear_fc1.weight (gate rows, then up rows)
  weight2 [E_local, H, F / etp]      = each expert's linear_fc2.weight
so checkpoints interchange with SequentialMLP both ways:
- `sharded_state_dict` emits exactly SequentialMLP's ShardedTensors (same keys, expert axis,
  expert-TP split, GLU factory, replica ids), so dist checkpoints load into either;
- plain `state_dict()` / `load_state_dict` speak SequentialMLP's per-expert names
  (`local_experts.{i}.linear_fc1.weight`), through the two hooks below;
- `expert_slices` gives the converters the same per-expert names and views.
Communication stays in megatron-core's token dispatcher, as for SequentialMLP: with expert
TP the outputs are partial sums that the dispatcher reduces.
"""

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from backend.model.grouped_gemm import grouped_linear
from backend.training.distributed import ProcessGroups

_LINEARS = {"weight1": ("linear_fc1", 0), "weight2": ("linear_fc2", 1)}  # name, TP dim per expert


class GroupedExperts(MegatronModule):
    """All local experts of one MoE layer as grouped GEMMs (SwiGLU, no bias)."""

    def __init__(
        self,
        num_local_experts: int,
        config,
        pg_collection=None,
        *,
        groups: ProcessGroups,
        gemm: str = "auto",
        recompute_act: bool = False,
        name: str | None = None,  # megatron-core >= 0.19 names each module top-down
    ):
        super().__init__(config=config)
        _check_config(config)
        etp = groups.size("etp")
        if config.moe_ffn_hidden_size % etp:
            raise ValueError(
                f"moe_ffn_hidden_size {config.moe_ffn_hidden_size} is not divisible by "
                f"expert tensor parallel size {etp}: choose etp dividing it"
            )
        self.num_local_experts, self.groups, self.gemm = num_local_experts, groups, gemm
        # selective recompute's "moe_act" (backend.model.recompute): the SwiGLU output is dropped
        # after fc2 and recomputed from fc1's output in backward, as megatron's TEGroupedMLP
        self.recompute_act = recompute_act
        ffn, hidden = config.moe_ffn_hidden_size // etp, config.hidden_size
        # no device under use_cpu_initialization, so a meta-device build stays on meta
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        make = dict(dtype=config.params_dtype, device=device)
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, 2 * ffn, hidden, **make))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, hidden, ffn, **make))
        self._init_weights(config)
        for name, (_, tp_dim) in _LINEARS.items():
            # what megatron's DDP, optimizer and grad-norm code read (as on SequentialMLP's linears)
            param = getattr(self, name)
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = (
                True,
                tp_dim + 1,
                1,
            )
            param.allreduce = not config.expert_model_parallel_size > 1
        self.register_state_dict_post_hook(_per_expert_state_dict)
        self.register_load_state_dict_pre_hook(_stack_per_expert_state_dict)

    def _init_weights(self, config) -> None:
        if not config.perform_initialization or self.weight1.device.type == "meta":
            return
        from megatron.core.tensor_parallel.random import (
            get_cuda_rng_tracker,
            get_expert_parallel_rng_tracker_name,
        )

        with torch.no_grad(), get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
            config.init_method(self.weight1)
            config.output_layer_init_method(self.weight2)

    def forward(
        self, hidden_TH: torch.Tensor, tokens_per_expert: torch.Tensor, probs_T: torch.Tensor
    ):
        """Rows sorted by local expert -> (outputs [T, H] weighted by the router probs, no bias)."""
        fc1_TN = grouped_linear(hidden_TH, self.weight1, tokens_per_expert, self.gemm)
        fused, dtype = self.config.bias_activation_fusion, hidden_TH.dtype

        def act(fc1_TN, probs_T1):
            return _weighted_swiglu(fc1_TN, probs_T1, fused).to(dtype)

        if not (self.recompute_act and torch.is_grad_enabled()):
            act_TF = act(fc1_TN, probs_T.unsqueeze(-1))
            return grouped_linear(act_TF, self.weight2, tokens_per_expert, self.gemm), None
        checkpoint = _checkpoint_without_output()
        act_TF = checkpoint.checkpoint(act, fc1_TN, probs_T.unsqueeze(-1))
        out_TH = grouped_linear(act_TF, self.weight2, tokens_per_expert, self.gemm)
        checkpoint.discard_output_and_register_recompute(out_TH)
        return out_TH, None

    # ---- checkpoints ------------------------------------------------------------------

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ):
        """SequentialMLP's sharded state dict, built from the stacked weights (views, no copies)."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        if (metadata or {}).get("singleton_local_shards"):
            raise NotImplementedError(
                "GroupedExperts does not write singleton_local_shards checkpoints: "
                "save without that metadata flag (the default)"
            )
        g = self.groups
        etp_rank, etp = g.rank("etp"), g.size("etp")
        first, total = g.rank("ep") * self.num_local_experts, g.size("ep") * self.num_local_experts
        out = {}
        for i in range(self.num_local_experts):
            offsets = (*sharded_offsets, (len(sharded_offsets), first + i, total))
            n, local, key = len(offsets), f"{prefix}local_experts.{i}.", f"{prefix}experts."
            for name, (linear, tp_dim) in _LINEARS.items():
                tensor = ShardedTensor.from_rank_offsets(
                    f"{key}{linear}.weight",
                    getattr(self, name)[i],
                    *offsets,
                    (n + tp_dim, etp_rank, etp),
                    replica_id=(0, 0, g.rank("edp")),
                    prepend_axis_num=n,
                )
                # fc1 holds gate and up: megatron stores them as two halves of one global tensor
                out[f"{local}{linear}.weight"] = (
                    apply_swiglu_sharded_factory(tensor, offsets) if tp_dim == 0 else tensor
                )
                shape, offset = zip(*[(frag, pos) for _, pos, frag in sorted(offsets)], strict=True)
                out[f"{local}{linear}._extra_state"] = ShardedObject(
                    f"{key}{linear}._extra_state", None, shape, offset, (0, etp_rank, g.rank("edp"))
                )
        return out

    def expert_slices(
        self, prefix: str, name: str, value: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """(SequentialMLP name, per-expert view carrying its TP attributes, value[i]) per local expert."""
        linear, tp_dim = _LINEARS[name]
        stacked = getattr(self, name).detach()
        for i in range(self.num_local_experts):
            view = stacked[i]
            view.tensor_model_parallel, view.partition_dim = True, tp_dim
            yield f"{prefix}local_experts.{i}.{linear}.weight", view, value[i]


def _checkpoint_without_output():
    """megatron-core's CheckpointWithoutOutput, fp8 off on every version: 0.16's takes
    `fp8` and turns it on for anything but None (its callers pass config.fp8, None unless
    fp8 training); 0.12.1's takes no argument."""
    import inspect

    from megatron.core.tensor_parallel import CheckpointWithoutOutput

    if "fp8" in inspect.signature(CheckpointWithoutOutput).parameters:
        return CheckpointWithoutOutput(fp8=None)
    return CheckpointWithoutOutput()


def _check_config(config) -> None:
    problems = []
    if not config.gated_linear_unit or config.activation_func is not F.silu:
        problems.append("experts must be SwiGLU (gated_linear_unit=True, activation_func=F.silu)")
    if config.add_bias_linear:
        problems.append("expert linears must have no bias (add_bias_linear=False)")
    if config.moe_apply_probs_on_input:
        problems.append(
            "moe_apply_probs_on_input is not supported (probabilities weight the outputs)"
        )
    if problems:
        raise ValueError(
            "GroupedExperts: "
            + "; ".join(problems)
            + "; or use SequentialMLP (experts='sequential')"
        )


def _weighted_swiglu(fc1_TN: torch.Tensor, probs_T1: torch.Tensor, fused: bool) -> torch.Tensor:
    """silu(gate) * up * prob, as megatron's MLP computes it (its fused kernel where it uses one)."""
    if fused:
        from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

        return weighted_bias_swiglu_impl(fc1_TN, None, probs_T1)
    gate_TF, up_TF = torch.chunk(fc1_TN, 2, dim=-1)
    return F.silu(gate_TF) * up_TF * probs_T1


# ---- plain state dicts in SequentialMLP's names ---------------------------------------


def _per_expert_state_dict(
    module: GroupedExperts, state_dict: dict, prefix: str, local_metadata
) -> None:
    for name, (linear, _) in _LINEARS.items():
        stacked = state_dict.pop(prefix + name)
        for i in range(module.num_local_experts):
            state_dict[f"{prefix}local_experts.{i}.{linear}.weight"] = stacked[i]
            state_dict[f"{prefix}local_experts.{i}.{linear}._extra_state"] = None


def _stack_per_expert_state_dict(
    module: GroupedExperts, state_dict: dict, prefix: str, *args
) -> None:
    for name, (linear, _) in _LINEARS.items():
        keys = [
            f"{prefix}local_experts.{i}.{linear}.weight" for i in range(module.num_local_experts)
        ]
        if prefix + name not in state_dict and all(k in state_dict for k in keys):
            state_dict[prefix + name] = torch.stack([state_dict.pop(k) for k in keys])
        for i in range(module.num_local_experts):
            state_dict.pop(f"{prefix}local_experts.{i}.{linear}._extra_state", None)
